"""The mlxd stack in a throw-away home, for tests and benchmarks: a config on
free loopback ports, the real stack started the way a user starts it
(`mlxd up --detach`), polled until ready, and stopped by pid whatever state
it was left in."""

from __future__ import annotations

import json
import subprocess
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import requests

from mlxd.config import Config, apply_env_overrides, parse_config
from mlxd.devkit.engine_process import MLXD, mlxd_env, with_key
from mlxd.devkit.ports import free_port
from mlxd.devkit.wait import wait_for
from mlxd.keyfile import ENGINE_KEY_PREFIX, ensure_key_file
from mlxd.paths import StatePaths
from mlxd.records import CrashRecord, EnginePid, SupervisionFile
from mlxd.supervisor.control import kill_all
from mlxd.supervisor.journal import read_records
from mlxd.toml_text import dumps

__all__ = ["MLXD", "Stack", "stack_env", "stack_toml"]

# More settings of one table: values (mlxd.toml_text writes them) or TOML text.
Extra = str | Mapping[str, Any]


def stack_toml(model: Path, model_name: str, engine_port: int, gateway_port: int | None, *, engine: Extra = "",
               supervisor: Extra = "", gateway: Extra = "", models: Extra = "") -> str:
    """The config of a one-model stack (gateway_port None: no gateway).
    `engine`, `supervisor` and `gateway` are more settings of those tables,
    `models` of the model's table (as TOML text, it may add tables after it)."""
    gateway_table: dict[str, Any] = {"enabled": False} if gateway_port is None else {"port": gateway_port}
    return (_table(("engine",), {"port": engine_port}, engine) + _table(("supervisor",), {}, supervisor)
            + _table(("gateway",), gateway_table, gateway if gateway_port is not None else "")
            + _table(("models", model_name), {"path": model}, models)
            + dumps({"aliases": {"default": model_name}}))


def _table(path: tuple[str, ...], values: dict[str, Any], extra: Extra) -> str:
    """One table: `values` with `extra`'s on top, or followed by `extra`'s lines."""
    if isinstance(extra, Mapping):
        values, extra = {**values, **extra}, ""
    for name in reversed(path):
        values = {name: values}
    return dumps(values) + extra + "\n"


def stack_env(home: Path, fault_file: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a stack in `home` (mlxd_env: offline,
    none of the caller's MLXD_* overrides unless in `extra`), fault
    injection from `fault_file` when given."""
    faults = {} if fault_file is None else {"MLXD_FAULT_FILE": str(fault_file)}
    return mlxd_env(home, {**faults, **(extra or {})})


@dataclass
class Stack:
    """A running (or about to run) mlxd: supervisord, the crash listener,
    the engine and, unless disabled, the gateway, all in `home`."""

    home: Path
    env: dict[str, str]
    fault_file: Path | None = None

    @classmethod
    def create(cls, home: Path, model: Path, *, model_name: str = "demo-a", engine: Extra = "",
               supervisor: Extra = "", gateway: Extra | None = "", models: Extra = "",
               env: dict[str, str] | None = None, faults: bool = True) -> "Stack":
        """Write the config into `home` (engine and gateway on free ports;
        gateway None: no gateway; the rest: stack_toml's). Nothing runs until up(). With `faults`,
        the engine reads fault specs from `home/fault` (see engine/model/faults.py)."""
        home.mkdir(parents=True, exist_ok=True)
        gateway_port = None if gateway is None else free_port()
        (home / "mlxd.toml").write_text(stack_toml(model, model_name, free_port(), gateway_port, engine=engine,
                                                   supervisor=supervisor, gateway=gateway or "", models=models))
        fault_file = home / "fault" if faults else None
        return cls(home, stack_env(home, fault_file, env), fault_file)

    @cached_property
    def config(self) -> Config:
        """The config the stack's processes read: its file and this env's overrides."""
        path = self.home / "mlxd.toml"
        data = tomllib.loads(path.read_text()) if path.exists() else {}
        return parse_config(apply_env_overrides(data, self.env), self.home, str(path))

    @property
    def paths(self) -> StatePaths:
        return self.config.paths

    @property
    def url(self) -> str:
        """The engine's base URL, its key as the URL's password (devkit.engine_process.with_key)."""
        return with_key(self.config.engine_url, ensure_key_file(self.paths.engine_key, ENGINE_KEY_PREFIX))

    @property
    def bare_url(self) -> str:
        """The engine's base URL without its key."""
        return self.config.engine_url

    @property
    def gateway_url(self) -> str:
        return self.config.gateway_url

    @property
    def key(self) -> str:
        return self.paths.key.read_text().strip()

    def mlxd(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*MLXD, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def up(self, timeout: float = 120) -> None:
        """`mlxd up --detach`, then poll until ready; RuntimeError (with the
        logs) when either fails."""
        up = self.mlxd("up", "--detach", "--timeout", str(timeout), timeout=timeout + 60)
        if up.returncode != 0:
            raise RuntimeError(f"mlxd up exited {up.returncode}:\n{up.stdout}\n{up.stderr}\n{self.log_tail()}")
        if not wait_for(self.ready, timeout):
            raise RuntimeError(f"not ready {timeout}s after mlxd up:\n{self.log_tail()}")

    def healthy(self) -> bool:
        """The engine's /health answers 200."""
        return _ok(self.url + "/health")

    def ready(self) -> bool:
        """The engine is healthy and the gateway (when enabled) answers."""
        return self.healthy() and (not self.config.gateway.enabled or _ok(self.gateway_url + "/mlxd/health"))

    def status(self) -> dict:
        return json.loads(self.mlxd("status", "--json").stdout)

    def process_pid(self, name: str) -> int | None:
        """The pid supervisord reports for one of its programs."""
        for p in self.status()["processes"] or []:
            if p["name"] == name:
                return p["pid"]
        return None

    def engine_pid(self) -> int | None:
        rec = EnginePid.read(self.paths.engine_pid)
        return rec.pid if rec else None

    def records(self) -> list[CrashRecord]:
        """The crash journal, oldest first."""
        return read_records(self.paths.journal)

    def supervision(self) -> dict:
        """The listener's supervision state as written ({} before the first)."""
        rec = SupervisionFile.read(self.paths.supervision)
        return rec.to_json() if rec else {}

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of every log in the home (for failure messages)."""
        out = []
        for log in sorted(self.paths.logs.glob("*.log")) if self.paths.logs.is_dir() else []:
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name} (last {lines} lines):\n" + "\n".join(text))
        return "\n".join(out) or "(no logs)"

    def stop(self) -> None:
        """`mlxd down`, then SIGKILL by pid whatever is left: supervisord and its
        tree, and the engine and runner it recorded, even if orphaned."""
        if self.fault_file is not None:
            self.fault_file.unlink(missing_ok=True)
        try:
            self.mlxd("down", timeout=60)
        except (subprocess.TimeoutExpired, OSError):
            pass
        kill_all(self.paths)


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False
