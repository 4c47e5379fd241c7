"""A server process for a test or a benchmark, above all `mlxd engine`
alone (no supervisor): its config written into a home, started on a free
loopback port (or the one given) with its output in a log file, polled
until its health endpoint answers 200 within a deadline (never a bare
sleep), and stopped by pid. The one way tests (tests/testkit.py) and
benchmarks (bench/benchkit.py) start an engine; benchmarks start the
servers they compare with (mlx_lm.server) through spawn() too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import requests

from mlxd.devkit.ports import free_port
from mlxd.keyfile import ENGINE_KEY_PREFIX, ensure_key_file
from mlxd.paths import StatePaths
from mlxd.devkit.wait import wait_for
from mlxd.toml_text import dumps

MLXD = [sys.executable, "-m", "mlxd.cli"]
# The caller's overrides that would point a child at another config, port or fault.
FOREIGN_ENV = ("MLXD_CONFIG", "MLXD_FAULT", "MLXD_FAULT_MATCH", "MLXD_ENGINE_HOST", "MLXD_ENGINE_PORT",
               "MLXD_GATEWAY_HOST", "MLXD_GATEWAY_PORT", "MLXD_OLLAMA_URL")
LOG_LINES = 60  # of the log, in the message of a server that did not start


class NotReady(RuntimeError):
    """A server exited while starting, or did not answer within its deadline."""


def mlxd_env(home: Path, extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment of an mlxd process in `home`: this process's, offline,
    unbuffered, without the caller's MLXD_* overrides; `extra` on top (a
    None there unsets that variable)."""
    env: dict[str, str | None] = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env.update(MLXD_HOME=str(home), HF_HUB_OFFLINE="1", LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return {k: v for k, v in env.items() if v is not None}


def stop_by_pid(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the process itself (by pid: never a name or a group), then
    SIGKILL after `grace` seconds; nothing when it has already exited."""
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, sig)
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


@dataclass
class ServerProcess:
    """A started server: its process, port and log; ready once `health_path` answers 200."""

    home: Path | None
    port: int
    proc: subprocess.Popen
    log_path: Path
    extra_env: dict[str, str | None] = field(default_factory=dict)  # what it was given beyond mlxd_env's
    name: str = "mlxd engine"
    health_path: str = "/health"
    key: str | None = None  # an mlxd engine's key (every route but /livez requires it)
    failure: ClassVar[type[Exception]] = NotReady  # what wait_ready raises (a benchmark's own error)

    @property
    def url(self) -> str:
        """Its base URL; an engine's carries its key as the URL's password,
        which `requests`, `openai` (httpx) and aiohttp send as Basic auth and
        the engine accepts (mlxd.keyfile.authorization_key)."""
        return with_key(self.bare_url, self.key)

    @property
    def bare_url(self) -> str:
        """Its base URL without the key: what a client that does not hold it reaches."""
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict[str, Any]:
        return requests.get(self.url + self.health_path, timeout=5).json()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def ready(self) -> bool:
        """One probe: True once the health endpoint answers 200; `failure`
        when the process has exited."""
        if self.proc.poll() is not None:
            raise self.failure(f"{self.name} exited with {self.proc.returncode} while starting:\n"
                               f"{self.log_tail(LOG_LINES)}")
        try:
            return requests.get(self.url + self.health_path, timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, timeout: float) -> None:
        """Poll until ready; `failure` (with the log's tail) when it exits or the deadline passes."""
        if not wait_for(self.ready, timeout, 0.05):
            raise self.failure(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail(LOG_LINES)}")

    def stop(self, grace: float = 20.0) -> None:
        stop_by_pid(self.proc, grace)


def with_key(url: str, key: str | None) -> str:
    """`http://host:port` -> `http://mlxd:KEY@host:port` (pure; no key: as it is)."""
    if key is None:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://mlxd:{key}@{rest}"


def spawn(name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path, port: int,
          health_path: str = "/health", *, home: Path | None = None, extra_env: Mapping[str, str | None] | None = None,
          append: bool = False, preexec_fn: Callable[[], None] | None = None,
          kind: type[ServerProcess] = ServerProcess) -> ServerProcess:
    """Start `argv` with its output in `log_path` (appended to, with
    `append`), in a session of its own (a Ctrl-C reaches the caller only,
    which stops it), stdin closed; `kind`: the class of what is returned
    (a benchmark's, whose wait_ready raises its own error). Returns at
    once: see wait_ready()."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab" if append else "wb") as log:
        proc = subprocess.Popen(list(argv), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec_fn)
    return kind(home, port, proc, log_path, dict(extra_env or {}), name, health_path)


def start_engine(home: Path, config: str | Mapping[str, Any] | None, *, port: int | None = None,
                 env: Mapping[str, str | None] | None = None, log_path: Path | None = None, append: bool = False,
                 name: str = "mlxd engine", launcher: Sequence[str] = (),
                 preexec_fn: Callable[[], None] | None = None,
                 kind: type[ServerProcess] = ServerProcess) -> ServerProcess:
    """`mlxd engine` on `port` (a free one by default) with MLXD_HOME=`home`
    (mlxd_env, `env` on top). `config`: the mlxd.toml written into `home`
    first, as text or as values (mlxd.toml_text); None keeps the one there
    (a restart). Its output goes to `log_path` (default home/engine.log).
    `launcher` goes before the command (mlx.launch for a rank group).
    Returns at once: see wait_ready()."""
    home.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (home / "mlxd.toml").write_text(config if isinstance(config, str) else dumps(config))
    key = ensure_key_file(StatePaths(home).engine_key, ENGINE_KEY_PREFIX)  # as set-up makes it
    port = port or free_port()
    server = spawn(name, [*launcher, *MLXD, "engine", "--port", str(port)], mlxd_env(home, env),
                   log_path or home / "engine.log", port, "/health", home=home, extra_env=env, append=append,
                   preexec_fn=preexec_fn, kind=kind)
    server.key = key
    return server
