"""Status data for `mlxd status`: one function, one JSON-able dict.

Reads what is there without changing anything: supervisord's process table
(XML-RPC), the engine's /health, the listener's state file and the crash
journal. Each part degrades to None when its source is absent. (Autostart,
launchd's or systemd's, is added by the `mlxd status` command itself: the
supervisor does not know about the service manager above it.)
"""

from __future__ import annotations

import time
import xmlrpc.client
from typing import Any

from mlxd.config import Config
from mlxd.paths import StatePaths
from mlxd.probe import get_json
from mlxd.records import Quarantine, SupervisionFile

from . import journal
from .control import rpc, supervisord_pid


def _engine_health(config: Config) -> dict[str, Any]:
    return _get_json(f"{config.engine_url}/health")


def _gateway_health(config: Config) -> dict[str, Any] | None:
    if not config.gateway.enabled:
        return None
    return _get_json(f"{config.gateway_url}/mlxd/health")


def _get_json(url: str) -> dict[str, Any]:
    status, body = get_json(url, timeout=2.0)
    return {"url": url, "http_status": status, "health": body}


def other_hosts(config: Config) -> dict[str, list[str]]:
    """The engines on other hosts (base URL -> the model ids they serve),
    from the models' `hosts` (pure)."""
    hosts: dict[str, list[str]] = {}
    for model_id in config.models:
        for url in config.engine_urls(model_id):
            if url != config.engine_url:
                hosts.setdefault(url, []).append(model_id)
    return hosts


def _hosts(config: Config) -> list[dict[str, Any]]:
    """Each other host's /health (open: no key needed), probed in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    hosts = other_hosts(config)
    with ThreadPoolExecutor(max_workers=min(16, len(hosts) or 1)) as pool:
        answers = list(pool.map(lambda url: _get_json(url + "/health"), hosts))
    return [{"url": url, "models": models, "http_status": got["http_status"], "health": got["health"]}
            for (url, models), got in zip(hosts.items(), answers)]


def _rank_group(config: Config, paths: StatePaths) -> dict[str, Any] | None:
    """The engine's rank group (engine.ranks): its ranks, and the pids of
    those running on this Mac (the runner's engine processes)."""
    ranks = config.engine.ranks
    if not ranks.enabled:
        return None
    import psutil

    from mlxd.records import EnginePid

    def is_rank(p: psutil.Process) -> bool:
        try:
            return p.cmdline()[1:4] == ["-m", "mlxd.cli", "engine"]  # not the launcher's shells
        except psutil.Error:
            return False

    running = EnginePid.read(paths.engine_pid)
    try:
        children = psutil.Process(running.runner_pid).children(recursive=True) if running else []
    except psutil.Error:
        children = []
    pids = [p.pid for p in children if is_rank(p)]
    return {"backend": ranks.backend, "hosts": ranks.hosts, "hostfile": ranks.hostfile, "local_pids": pids}


def _processes(paths: StatePaths) -> list[dict[str, Any]] | None:
    try:
        infos = rpc(paths).supervisor.getAllProcessInfo()
    except (OSError, xmlrpc.client.Error):
        return None
    now = time.time()
    return [{"name": i["name"], "state": i["statename"], "pid": i["pid"] or None,
             "uptime_s": round(now - i["start"], 1) if i["statename"] == "RUNNING" and i["start"] else None,
             "description": i["description"]} for i in infos]


def _ollama(config: Config) -> dict[str, Any]:
    url = config.gateway.ollama_url.rstrip("/")
    got = _get_json(url + "/api/version")
    return {"url": url, "reachable": got["http_status"] == 200,
            "version": (got["health"] or {}).get("version") if got["health"] else None}


def _port_owners(config: Config, ours: set[int]) -> list[dict[str, Any]]:
    """Processes listening on our ports that are not ours: reported, never
    killed (a stale engine from another home, or a foreign program)."""
    import psutil

    wanted = {config.engine.port: "engine", config.gateway.port: "gateway"}
    found = []
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):
        return found
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in wanted and c.pid and c.pid not in ours:
            try:
                cmd = " ".join(psutil.Process(c.pid).cmdline())[:120]
            except psutil.Error:
                cmd = "?"
            found.append({"port": c.laddr.port, "for": wanted[c.laddr.port], "pid": c.pid, "cmdline": cmd})
    return found


def _our_pids(sup_pid: int | None) -> set[int]:
    import psutil

    if sup_pid is None:
        return set()
    try:
        p = psutil.Process(sup_pid)
        return {sup_pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.Error:
        return set()


def overall(sup_pid: int | None, engine_ok: bool, mode: str | None, gateway_ok: bool | None = None) -> str:
    """healthy / degraded (serving through the fallback) / down (pure).
    gateway_ok is None when there is no gateway (engine only)."""
    if sup_pid is None or gateway_ok is False:
        return "down"
    if engine_ok:
        return "healthy"
    return "degraded" if mode in ("degraded", "backoff", "starting", "running") else "down"


def collect_status(config: Config) -> dict[str, Any]:
    paths = config.paths
    now = time.time()
    sup_pid = supervisord_pid(paths)
    records = journal.read_records(paths.journal)
    supervision = SupervisionFile.read(paths.supervision) if sup_pid else None
    engine = _engine_health(config)
    gateway = _gateway_health(config) if sup_pid else None
    last = records[-1] if records else None
    quarantine = Quarantine.read(paths.quarantine) or Quarantine()
    return {
        "time": now,
        "home": str(config.home),
        "supervisord": {"running": sup_pid is not None, "pid": sup_pid},
        "processes": _processes(paths) if sup_pid else None,
        "engine": engine,
        "gateway": gateway,
        "supervision": supervision.to_json() if supervision else None,
        "crashes": {**journal.crash_counts(records, now),
                    "last": {"time": last.time, "class": last.klass, "signal": last.signal,
                             "exit_code": last.exit_code, "model": last.model, "request_id": last.request_id}
                    if last else None},
        "quarantined_requests": len(quarantine.active(now)),
        "ollama": _ollama(config) if config.gateway.enabled else None,
        "hosts": _hosts(config),
        "rank_group": _rank_group(config, paths) if sup_pid else None,
        "foreign_listeners": _port_owners(config, _our_pids(sup_pid)),
        "overall": overall(sup_pid, engine["http_status"] == 200, supervision.mode if supervision else None,
                           None if gateway is None else gateway["http_status"] == 200),
    }
