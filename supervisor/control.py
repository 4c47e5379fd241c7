"""Operating supervisord: prepare the state dir, start (foreground or
detached), talk XML-RPC over the 0700 unix socket, stop, restart the engine,
and clear what a kill -9 may have left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import xmlrpc.client
from pathlib import Path

import psutil

from mlxd.config import Config
from mlxd.paths import StatePaths, write_atomic
from mlxd.records import EnginePid

from .supervisord_conf import render_supervisord_conf


def rpc(paths: StatePaths) -> xmlrpc.client.ServerProxy:
    from supervisor.xmlrpc import SupervisorTransport

    transport = SupervisorTransport(None, None, serverurl=f"unix://{paths.socket}")
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return ""


def supervisord_pid(paths: StatePaths) -> int | None:
    """The pid of our live supervisord, or None (a stale pid file is not one)."""
    try:
        pid = int(paths.supervisord_pid.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if "supervisord" in _cmdline(pid) else None


def clean_stale(paths: StatePaths) -> list[str]:
    """After a kill -9 of supervisord: remove its pid file and socket and stop
    an orphaned engine still holding the port and GPU memory."""
    notes = []
    if supervisord_pid(paths) is not None:
        return notes
    for f in (paths.supervisord_pid, paths.socket):
        if f.exists():
            f.unlink()
            notes.append(f"removed stale {f.name}")
    rec = EnginePid.read(paths.engine_pid)
    for pid in (rec.pid, rec.runner_pid) if rec else ():
        if "mlxd" in _cmdline(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                notes.append(f"stopped orphaned engine process {pid}")
            except OSError:
                pass
    return notes


def kill_all(paths: StatePaths) -> None:
    """Last resort, by pid: supervisord with everything under it, and the
    engine (and its runner) it recorded, even if orphaned."""
    pids = []
    try:
        pids.append(int(paths.supervisord_pid.read_text()))
    except (OSError, ValueError):
        pass
    rec = EnginePid.read(paths.engine_pid)
    pids += [rec.runner_pid, rec.pid] if rec else []
    for pid in pids:
        try:
            for child in psutil.Process(pid).children(recursive=True):
                child.kill()
            os.kill(pid, signal.SIGKILL)
        except (psutil.Error, OSError):
            pass


def prepare(config: Config) -> Path:
    """State directory and a freshly generated supervisord.conf."""
    paths = config.paths
    paths.make_dirs()
    write_atomic(paths.supervisord_conf, render_supervisord_conf(config))
    return paths.supervisord_conf


def supervisord_argv(conf: Path) -> list[str]:
    return [sys.executable, "-m", "supervisor.supervisord", "-n", "-c", str(conf)]


def wait_for_socket(paths: StatePaths, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if rpc(paths).supervisor.getState()["statename"] == "RUNNING":
                return True
        except (OSError, xmlrpc.client.Error):
            pass
        time.sleep(0.1)
    return False


def start_detached(config: Config, timeout: float = 30.0) -> int:
    """Start supervisord in the background; returns its pid once it answers."""
    conf = prepare(config)
    paths = config.paths
    out = (paths.logs / "supervisord.out").open("ab")
    proc = subprocess.Popen(supervisord_argv(conf), stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, env=os.environ.copy())
    if not wait_for_socket(paths, timeout):
        raise RuntimeError(f"supervisord did not come up in {timeout:.0f}s; see {paths.logs / 'supervisord.out'}")
    return proc.pid


def shutdown(paths: StatePaths, timeout: float = 60.0) -> bool:
    pid = supervisord_pid(paths)
    if pid is None:
        return False
    try:
        rpc(paths).supervisor.shutdown()
    except (OSError, xmlrpc.client.Error):
        os.kill(pid, signal.SIGTERM)
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        os.kill(pid, signal.SIGKILL)
    return True


OPERATOR_RESTART = ("mlxd", "operator-restart")  # supervisord remote-communication (type, data)


def restart_gateway(paths: StatePaths) -> bool:
    """Restart the gateway program if it runs (it reads the engine's key at
    start, for LiteLLM's deployments); False where there is none running."""
    server = rpc(paths)
    try:
        info = server.supervisor.getProcessInfo("gateway")
    except xmlrpc.client.Fault:  # no gateway program ([gateway] enabled = false)
        return False
    if info["statename"] not in ("RUNNING", "STARTING"):
        return False
    server.supervisor.stopProcess("gateway", True)
    server.supervisor.startProcess("gateway", False)
    return True


def restart_engine(paths: StatePaths) -> None:
    """An operator's restart: tell the crash listener (it clears the crash
    history, a crash loop included), have the standby keeper replace its
    waiting engine, then stop (draining) if running, and start."""
    from .standby import discard_standby

    server = rpc(paths)
    server.supervisor.sendRemoteCommEvent(*OPERATOR_RESTART)
    discard_standby(paths.standby_socket)  # an operator's restart imports afresh: new code, new config
    info = server.supervisor.getProcessInfo("engine")
    if info["statename"] in ("RUNNING", "STARTING"):
        server.supervisor.stopProcess("engine", True)
    server.supervisor.startProcess("engine", False)
