"""Test helpers shared by every test folder (on sys.path via pytest's
`pythonpath`): free ports, polling with a deadline, real engine processes
and small HTTP shortcuts."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests

from mlxd.paths import StatePaths, read_json
from mlxd.supervisor.journal import read_records

MLXD = [sys.executable, "-m", "mlxd.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], object], timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `condition` until it returns something truthy; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class EngineProcess:
    home: Path
    port: int
    proc: subprocess.Popen
    log_path: Path
    extra_env: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=5).json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def spawn_engine(home: Path, toml: str, env: dict | None = None) -> EngineProcess:
    """Write the config into `home` and start `mlxd engine` on a free port."""
    (home / "mlxd.toml").write_text(toml)
    port = free_port()
    log_path = home / "engine.log"
    full_env = {**os.environ, "MLXD_HOME": str(home), "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("MLXD_CONFIG", None)
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen([*MLXD, "engine", "--port", str(port)], env=full_env,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    return EngineProcess(home, port, proc, log_path, env or {})


def wait_healthy(ep: EngineProcess, timeout: float = 90) -> None:
    def ok() -> bool:
        if ep.proc.poll() is not None:
            raise AssertionError(f"engine exited with {ep.proc.returncode}:\n{ep.log()}")
        try:
            return requests.get(ep.url + "/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    wait_until(ok, timeout, what="engine /health 200")




def chat(url: str, model: str = "default", content: str = "hello", max_tokens: int = 4, timeout: float = 60,
         **extra) -> requests.Response:
    """POST a one-message chat completion; returns the raw response."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def metric(url: str, name: str) -> float:
    """One sample of a Prometheus metric from /metrics (no labels)."""
    text = requests.get(url + "/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"metric {name} not found"
    return float(m.group(1))




@dataclass
class Stack:
    """A running mlxd (supervisord, engine, listener, maybe the gateway)."""

    home: Path
    port: int
    env: dict
    fault_file: Path
    gateway_port: int | None = None

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def key(self) -> str:
        return self.paths.key.read_text().strip()

    @property
    def paths(self) -> StatePaths:
        return StatePaths(self.home)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def mlxd(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*MLXD, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def status(self) -> dict:
        return json.loads(self.mlxd("status", "--json").stdout)

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def engine_pid(self) -> int | None:
        return (read_json(self.paths.engine_pid) or {}).get("pid")

    def records(self) -> list[dict]:
        return [r.to_json() for r in read_records(self.paths.journal)]

    def supervision(self) -> dict:
        return read_json(self.paths.supervision) or {}

    def process_pid(self, name: str) -> int | None:
        for p in self.status()["processes"] or []:
            if p["name"] == name:
                return p["pid"]
        return None


def kill_stack(stack: Stack) -> None:
    """Teardown by pid, whatever state the test left: supervisord, then any
    engine or runner it may have orphaned."""
    from mlxd.supervisor.control import kill_all

    kill_all(stack.paths)
