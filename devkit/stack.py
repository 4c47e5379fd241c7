"""The mlxd stack in a throw-away home, for tests and benchmarks: a config on
free loopback ports, the real stack started the way a user starts it
(`mlxd up --detach`), polled until ready, and stopped by pid whatever state
it was left in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import requests

from mlxd.config import Config, apply_env_overrides, parse_config
from mlxd.devkit.ports import free_port
from mlxd.devkit.wait import wait_for
from mlxd.paths import StatePaths
from mlxd.records import CrashRecord, EnginePid, SupervisionFile
from mlxd.supervisor.control import kill_all
from mlxd.supervisor.journal import read_records

MLXD = [sys.executable, "-m", "mlxd.cli"]
# The caller's overrides that would point a stack at another config, port or fault.
FOREIGN_ENV = ("MLXD_CONFIG", "MLXD_FAULT", "MLXD_FAULT_MATCH", "MLXD_ENGINE_HOST", "MLXD_ENGINE_PORT",
               "MLXD_GATEWAY_HOST", "MLXD_GATEWAY_PORT", "MLXD_OLLAMA_URL")


def toml_lines(**values: object) -> str:
    """`key = value` lines for a TOML table (JSON scalars are TOML scalars)."""
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())


def stack_toml(model: Path, model_name: str, engine_port: int, gateway_port: int | None, *, engine: str = "",
               supervisor: str = "", gateway: str = "", models: str = "") -> str:
    """The config of a one-model stack; `engine`, `supervisor`, `gateway` and
    `models` are extra TOML lines for those tables (`models`: more tables)."""
    gateway_table = "enabled = false\n" if gateway_port is None else f"port = {gateway_port}\n{gateway}"
    return (f"[engine]\nport = {engine_port}\n{engine}\n[supervisor]\n{supervisor}\n[gateway]\n{gateway_table}\n"
            f"[models.{model_name}]\npath = {json.dumps(str(model))}\n{models}\n"
            f"[aliases]\ndefault = {json.dumps(model_name)}\n")


def stack_env(home: Path, fault_file: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a stack in `home`: offline, none of the
    caller's MLXD_* overrides (unless in `extra`), fault injection from
    `fault_file` when given."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env.update(MLXD_HOME=str(home), HF_HUB_OFFLINE="1", LITELLM_LOCAL_MODEL_COST_MAP="True")
    if fault_file is not None:
        env["MLXD_FAULT_FILE"] = str(fault_file)
    return {**env, **(extra or {})}


@dataclass
class Stack:
    """A running (or about to run) mlxd: supervisord, the crash listener,
    the engine and, unless disabled, the gateway, all in `home`."""

    home: Path
    env: dict[str, str]
    fault_file: Path | None = None

    @classmethod
    def create(cls, home: Path, model: Path, *, model_name: str = "demo-a", engine: str = "",
               supervisor: str = "", gateway: str | None = "", models: str = "",
               env: dict[str, str] | None = None, faults: bool = True) -> "Stack":
        """Write the config into `home` (engine and gateway on free ports;
        gateway None: no gateway). Nothing runs until up(). With `faults`,
        the engine reads fault specs from `home/fault` (see engine/faults.py)."""
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
