"""`mlxd status` as a table (pure): the stack's report (mlxd.reports'
StatusReport) one line a part, with the engine's model, batch, memory and
prompt cache, the standby engine, crashes, hosts and warnings."""

from __future__ import annotations

import time

from mlxd import default_model
from mlxd.durations import describe
from mlxd.records import StandbyFile, StartedWith
from mlxd.reports import EngineHealth, PromptCacheReport, ReuseLine, StatusReport


def format_prompt_cache(pc: PromptCacheReport) -> str:
    """One line: how much of the prompts the cache served, and what it holds."""
    if not pc.enabled:
        return "off"
    mib = 2**20
    line = (f"{pc.hit_rate:.0%} of prompt tokens reused ({pc.hits}/{pc.requests} requests hit), "
            f"memory {pc.memory_bytes / mib:.0f} of {pc.memory_budget_bytes / mib:.0f} MiB "
            f"({pc.memory_entries} entries)")
    if pc.disk_enabled:
        line += (f", disk {pc.disk_bytes / mib:.0f} of {pc.disk_budget_bytes / mib:.0f} MiB "
                 f"({pc.disk_entries} entries)")
    return line + ("" if pc.disk_enabled else ", disk off")


def format_running(health: EngineHealth | None) -> str:
    """The requests generating now: with batching, how many of how many
    slots, and their ids (an older engine reports one `in_flight`)."""
    if health is None or health.running is None:
        return f"in flight {(health.in_flight if health else None) or '-'}"
    running, slots = health.running, health.max_concurrency or 1
    if slots <= 1:
        return f"in flight {running[0] if running else '-'}"
    shown = ", ".join(running[:4]) + (f", +{len(running) - 4}" if len(running) > 4 else "")
    return f"batch {len(running)}/{slots}" + (f" ({shown})" if running else "")


def format_recent_reuse(recent: list[ReuseLine]) -> list[str]:
    """Per recent conversation, newest first: how much of its latest prompt
    was reused, and where and why reuse stopped (which agent field broke it)."""
    if not recent:
        return []
    rows = ["    conversation  prompt  reused  stopped at  why"]
    for r in reversed(recent):
        stopped = "-" if r.stopped_at is None else str(r.stopped_at)
        rows.append(f"    {r.conversation:<12}  {r.prompt_tokens:>6}  {r.cached_tokens:>6}  {stopped:>10}  {r.why}")
    return rows


def format_started_with(record: StartedWith | None) -> str | None:
    """The MLXD_* variables `mlxd up` was started with, which status and
    the other commands use unless set now; None when there were none."""
    if record is None or not record.env:
        return None
    return " ".join(f"{name}={value}" for name, value in sorted(record.env.items())) + "  (from `mlxd up`)"


def format_model(health: EngineHealth | None) -> str:
    """The resident model as status shows it: its id, the default model's
    name, and a quantised KV cache's bits (pure)."""
    model = (health.resident_model if health else None) or "-"
    if health and health.resident_model is None and health.unloaded_idle_at is not None:
        at = time.strftime("%H:%M", time.localtime(health.unloaded_idle_at))
        return f"- (idle: {health.unloaded_idle_model or 'the model'} unloaded at {at}; the next request loads it)"
    if model == default_model.MODEL_ID:
        model = f"{model} ({default_model.MODEL_NAME})"
    bits = health.kv_bits if health else 16
    notes = ([f"KV {bits}-bit"] if bits < 16 else []) + (["tools by mlxd"] if health and health.tools == "mlxd" else [])
    if health and health.unload_in_s is not None:
        notes.append(f"unloads if idle {describe(health.unload_in_s)} more")
    return f"{model} ({', '.join(notes)})" if notes else model


def _or_dash(value: object) -> object:
    return "-" if value is None else value


def format_standby(sb: StandbyFile) -> str:
    """The standby engine's line: what a crash's restart would find."""
    took = f", {sb.handovers} takeover{'s' if sb.handovers != 1 else ''}" if sb.handovers else ""
    if sb.pid is None:
        return f"none waiting (the next starts shortly){took}"
    if not sb.ready:
        return f"pid {sb.pid} importing{took}"
    return f"ready, pid {sb.pid} (imported in {sb.import_s or 0:.1f}s): a crashed engine is replaced by it{took}"


def format_status(st: StatusReport) -> str:
    lines = [f"mlxd: {st.overall}   (home {st.home})"]
    sup = st.supervisord
    lines.append(f"  supervisord   {'running pid ' + str(sup.pid) if sup.running else 'not running'}")
    started = format_started_with(st.started_with)
    if started:
        lines.append(f"  started with  {started}")
    for p in st.processes or []:
        up = f"up {p.uptime_s:.0f}s" if p.uptime_s is not None else ""
        lines.append(f"  {p.name:<13} {p.state:<9} pid {p.pid or '-':<7} {up}")
    h = st.engine.health
    gw = st.gateway
    if gw is not None:
        lines.append(f"  gateway       {'ok' if gw.ok else 'no answer'}  {gw.url.rsplit('/', 2)[0]}")
    lines.append(f"  engine        {h.status if h else 'no answer'}  model {format_model(h)}  "
                 f"queue {_or_dash(h and h.queue_depth)}  {format_running(h)}")
    mem = h.memory if h else None
    if mem:
        gib = 2**30
        lines.append(f"  memory        MLX active {mem.mlx_active_bytes / gib:.2f} GiB, "
                     f"peak {mem.mlx_peak_bytes / gib:.2f} GiB, RSS {mem.rss_bytes / gib:.2f} GiB "
                     f"of budget {mem.budget_bytes / gib:.1f} GiB")
    pc = h.prompt_cache if h else None
    if pc is not None:
        lines.append(f"  prompt cache  {format_prompt_cache(pc)}")
        lines += format_recent_reuse(pc.recent)
    sv = st.supervision
    if sv:
        restart_at = sv.state.get("restart_at")
        extra = f"  next start in {max(0.0, restart_at - st.time):.0f}s" if restart_at else ""
        lines.append(f"  supervision   {sv.mode}{extra}")
    sb = st.standby
    if sb:
        lines.append(f"  standby       {format_standby(sb)}")
    c = st.crashes
    last_s = f"  last: {c.last.klass} at {time.strftime('%H:%M:%S', time.localtime(c.last.time))}" if c.last else ""
    lines.append(f"  crashes       {c.last_hour} last hour, {c.last_day} last day{last_s}")
    ol = st.ollama
    if ol is not None:
        lines.append(f"  ollama        {'answers (' + str(ol.version) + ')' if ol.reachable else 'no answer'}"
                     f"  {ol.url}{'' if ol.reachable else '  (no fallback while the engine is down)'}")
    rg = st.rank_group
    if rg:
        where = ", ".join(rg.hosts) if rg.hosts else f"hostfile {rg.hostfile}"
        pids = ", ".join(map(str, rg.local_pids)) or "none running"
        lines.append(f"  rank group    {len(rg.hosts) or '?'} ranks ({rg.backend}): {where}; on this Mac: pids {pids}")
    for host in st.hosts:
        hh = host.health
        lines.append(f"  host          {host.url}  {hh.status if hh and host.ok else 'no answer'}  "
                     f"model {(hh.resident_model if hh else None) or '-'}  "
                     f"queue {_or_dash(hh and hh.queue_depth)}  {format_running(hh)}  (serves {', '.join(host.models)})")
    au = st.autostart
    if au:
        lines.append(f"  {au.get('kind', 'autostart'):<13} {au.get('detail', '')}")
    for f in st.foreign_listeners:
        lines.append(f"  WARNING       port {f.port} ({f.used_for}) is held by pid {f.pid}: {f.cmdline}")
    if st.quarantined_requests:
        lines.append(f"  quarantined   {st.quarantined_requests} request(s)")
    if st.suspected_requests:
        lines.append(f"  suspects      {st.suspected_requests} request(s) decoded alone (in flight at a crash with others)")
    return "\n".join(lines)
