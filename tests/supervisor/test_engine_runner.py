"""The engine runner (supervisor/engine_runner.py) and the engine it starts,
as real processes: an engine whose runner is killed by pid (`mlxd down`'s
last resort, or a runner killed between its start and its pid file) exits
too, so no orphan keeps the port and the memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from mlxd.devkit.ports import free_port
from mlxd.paths import StatePaths
from mlxd.records import EnginePid
from mlxd.toml_text import dumps
from testkit import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_an_engine_exits_when_its_runner_is_killed(tmp_path):
    (tmp_path / "mlxd.toml").write_text(dumps({"engine": {"port": free_port()}, "models": {"m": {"demo": "a"}}}))
    env = {**os.environ, "MLXD_HOME": str(tmp_path)}
    runner = subprocess.Popen([sys.executable, "-m", "mlxd.supervisor.engine_runner"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    engine = None
    try:
        record = wait_until(lambda: EnginePid.read(StatePaths(tmp_path).engine_pid), 60, what="the engine's pid file")
        engine = record.pid
        assert record.runner_pid == runner.pid and alive(engine)
        runner.send_signal(signal.SIGKILL)
        runner.wait(10)
        wait_until(lambda: not alive(engine), 30, what="the orphaned engine to exit")
    finally:
        for pid in (runner.pid, engine):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        runner.wait(10)
