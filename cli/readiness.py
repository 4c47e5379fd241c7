"""Waiting for a started stack: the engine's /health, showing its phase,
then the gateway's; why it cannot start, from the crash journal, once
retrying will not help; and whether the engine that answers is the one
this supervisord started (`mlxd up`, `mlxd restart`)."""

from __future__ import annotations

import re
import sys
import time

import psutil

from mlxd import exit_codes
from mlxd.config import Config
from mlxd.keyfile import engine_headers
from mlxd.probe import get_json
from mlxd.reports import EngineHealth


def wait_ready(config: Config, timeout: float, alive=lambda: True, supervisord: int | None = None) -> str | None:
    """Poll the engine's /health (showing its phase), then the gateway's.
    None once both answer; otherwise why not, in a line for the user (a
    timeout, supervisord gone, or an engine that cannot start). With the
    supervisord's pid, only an engine under it counts as ready."""
    deadline = time.monotonic() + timeout
    not_ready = f"not ready after {timeout:.0f}s; see `mlxd status` and `mlxd logs`"
    failure = _wait_engine(config, deadline, alive, supervisord)
    if failure is not None or not alive():
        return failure or "supervisord exited; see `mlxd logs supervisord`"
    if time.monotonic() >= deadline:
        return f"the engine is {not_ready}"
    if not config.gateway.enabled:
        return None
    print("gateway: starting", file=sys.stderr, flush=True)
    while time.monotonic() < deadline and alive():
        if get_json(config.gateway_url + "/mlxd/health")[0] == 200:
            print("gateway: ready", file=sys.stderr)
            return None
        time.sleep(0.2)
    return f"the gateway is {not_ready}"


def _start_failure(config: Config, since: float) -> str | None:
    """Why the engine cannot start, once the journal says retrying will not
    help (its model, its config or its port): the engine's last words."""
    from mlxd.supervisor.journal import read_records

    for record in reversed(read_records(config.paths.journal)):
        if record.time < since:
            break
        if record.klass in ("preload_failed", "config_error") or record.exit_code == exit_codes.STARTUP_FAILED:
            lines = [line for line in record.stderr_tail.splitlines() if line.strip()]
            # the exception's message, without its class ("mlxd.engine.model.errors.EngineError: ...")
            return re.sub(r"^[\w.]+(Error|Exception): ", "", lines[-1]) if lines else record.klass
    return None


def runs_under(pid: int | None, ancestor: int | None) -> bool:
    """Whether process `pid` descends from `ancestor` (True when either is
    unknown: an engine too old to report its pid)."""
    if pid is None or ancestor is None:
        return True
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def _engine_pid(body: object) -> int | None:
    health = EngineHealth.from_json(body)
    return health.pid if health else None


def _wait_engine(config: Config, deadline: float, alive, supervisord: int | None = None) -> str | None:
    """Show the engine's phase until it answers 200; a reason if it cannot start."""
    url = f"{config.engine_url}/health"
    shown = ""
    since = time.time()
    while time.monotonic() < deadline and alive():
        failure = _start_failure(config, since)
        if failure is not None:
            return (f"the engine cannot start: {failure}\n  Fix: see `mlxd logs engine`, fix it, then "
                    f"`mlxd restart` (meanwhile the gateway answers through Ollama)")
        status, body = get_json(url, headers=engine_headers(config.paths.engine_key))
        if status == 200 and not runs_under(_engine_pid(body), supervisord):
            status = None  # another program's engine took the port after the preflight: not ours to call ready
        if status == 200:
            print("\rengine: ready" + " " * 30, file=sys.stderr)
            return None
        if status is not None:
            health = EngineHealth.from_json(body)
            phase = (health.reason if health else None) or "starting"
            if phase != shown:
                print(f"\rengine: {phase}" + " " * 20, end="", file=sys.stderr, flush=True)
                shown = phase
        time.sleep(0.2)
    return None
