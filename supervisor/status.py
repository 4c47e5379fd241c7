"""Status data for `mlxd status`: one function, one StatusReport
(mlxd.reports; this module is its writer).

Reads what is there without changing anything: supervisord's process table
(XML-RPC), the engine's /health, the listener's state file and the crash
journal. Each part degrades to None when its source is absent. (Autostart,
launchd's or systemd's, is added by the `mlxd status` command itself: the
supervisor does not know about the service manager above it.)
"""

from __future__ import annotations

import time
import xmlrpc.client

from mlxd.config import Config
from mlxd.paths import StatePaths
from mlxd.keyfile import engine_headers
from mlxd.probe import get_json
from mlxd.records import Quarantine, StandbyFile, SupervisionFile
from mlxd.reports import (CrashCounts, EngineHealth, EngineProbe, ForeignListener, GatewayProbe, HostProbe,
                          LastCrash, OllamaProbe, ProcessInfo, RankGroup, StatusReport, SupervisordState)

from . import journal
from .control import rpc, supervisord_pid


def probe_engine(url: str, headers: dict[str, str] | None = None) -> EngineProbe:
    """GET an engine's /health once, with its key (never raises: see mlxd.probe)."""
    status, body = get_json(url, timeout=2.0, headers=headers)
    return EngineProbe(url=url, http_status=status, health=EngineHealth.from_json(body))


def _gateway_health(config: Config) -> GatewayProbe | None:
    if not config.gateway.enabled:
        return None
    url = f"{config.gateway_url}/mlxd/health"
    status, body = get_json(url, timeout=2.0)
    return GatewayProbe(url=url, http_status=status, health=body if isinstance(body, dict) else None)


def other_hosts(config: Config) -> dict[str, list[str]]:
    """The engines on other hosts (base URL -> the model ids they serve),
    from the models' `hosts` (pure)."""
    hosts: dict[str, list[str]] = {}
    for model_id in config.models:
        for url in config.engine_urls(model_id):
            if url != config.engine_url:
                hosts.setdefault(url, []).append(model_id)
    return hosts


def _hosts(config: Config) -> list[HostProbe]:
    """Each other host's /health (with this machine's engine key, which
    every host holds), probed in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    hosts = other_hosts(config)
    headers = engine_headers(config.paths.engine_key)
    with ThreadPoolExecutor(max_workers=min(16, len(hosts) or 1)) as pool:
        answers = list(pool.map(lambda url: probe_engine(url + "/health", headers), hosts))
    return [HostProbe(url=url, models=models, http_status=got.http_status, health=got.health)
            for (url, models), got in zip(hosts.items(), answers)]


def _rank_group(config: Config, paths: StatePaths) -> RankGroup | None:
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
    return RankGroup(backend=ranks.backend, hosts=list(ranks.hosts), hostfile=ranks.hostfile, local_pids=pids)


def _processes(paths: StatePaths) -> list[ProcessInfo] | None:
    try:
        infos = rpc(paths).supervisor.getAllProcessInfo()
    except (OSError, xmlrpc.client.Error):
        return None
    now = time.time()
    return [ProcessInfo(name=i["name"], state=i["statename"], pid=i["pid"] or None,
                        uptime_s=round(now - i["start"], 1) if i["statename"] == "RUNNING" and i["start"] else None,
                        description=i["description"]) for i in infos]


def _ollama(config: Config) -> OllamaProbe:
    url = config.gateway.ollama_url.rstrip("/")
    status, body = get_json(url + "/api/version", timeout=2.0)
    version = body.get("version") if isinstance(body, dict) else None
    return OllamaProbe(url=url, reachable=status == 200, version=version if isinstance(version, str) else None)


def _port_owners(config: Config, ours: set[int]) -> list[ForeignListener]:
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
            found.append(ForeignListener(port=c.laddr.port, used_for=wanted[c.laddr.port], pid=c.pid, cmdline=cmd))
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


def collect_status(config: Config) -> StatusReport:
    paths = config.paths
    now = time.time()
    sup_pid = supervisord_pid(paths)
    records = journal.read_records(paths.journal)
    supervision = SupervisionFile.read(paths.supervision) if sup_pid else None
    engine = probe_engine(f"{config.engine_url}/health", engine_headers(paths.engine_key))
    gateway = _gateway_health(config) if sup_pid else None
    last = records[-1] if records else None
    quarantine = Quarantine.read(paths.quarantine) or Quarantine()
    return StatusReport(
        time=now,
        home=str(config.home),
        supervisord=SupervisordState(running=sup_pid is not None, pid=sup_pid),
        processes=_processes(paths) if sup_pid else None,
        engine=engine,
        gateway=gateway,
        supervision=supervision,
        standby=StandbyFile.read(paths.standby) if sup_pid else None,
        crashes=CrashCounts(**journal.crash_counts(records, now),
                            last=LastCrash(time=last.time, klass=last.klass, signal=last.signal,
                                           exit_code=last.exit_code, model=last.model, request_id=last.request_id)
                            if last else None),
        quarantined_requests=len(quarantine.active(now)),
        suspected_requests=sum(1 for until in quarantine.suspects.values() if until > now),
        ollama=_ollama(config) if config.gateway.enabled else None,
        hosts=_hosts(config),
        rank_group=_rank_group(config, paths) if sup_pid else None,
        foreign_listeners=_port_owners(config, _our_pids(sup_pid)),
        overall=overall(sup_pid, engine.ok, supervision.mode if supervision else None,
                        None if gateway is None else gateway.ok),
    )
