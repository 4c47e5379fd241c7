"""The stack commands of `mlxd`: up, down, restart, status (thin shells over
mlxd.supervisor's control and status)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import replace

import psutil

from mlxd import default_model, exit_codes
from mlxd.config import DEMO_MODEL_ID, Config, ConfigError, config_path, load_config
from mlxd.durations import describe
from mlxd.probe import get_json
from mlxd.records import StandbyFile, StartedWith
from mlxd.reports import EngineHealth, PromptCacheReport, ReuseLine, StatusReport
from mlxd.supervisor import control
from mlxd.supervisor.status import collect_status

from . import preflight, started_with

STATUS_EXIT = {"healthy": 0, "degraded": 1, "down": 2}


def _wait_ready(config: Config, timeout: float, alive=lambda: True, supervisord: int | None = None) -> str | None:
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
        status, body = get_json(url)
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


def with_default_model(config: Config) -> Config:
    """With no model configured, the real default model: fetched now, with
    its progress, where set-up did not (mlxd installed with pip alone), and
    the config read again to serve it. Where it cannot be had, the fetch says
    why in one line and `_first_run` that the demo model answers instead."""
    if list(config.models) != [DEMO_MODEL_ID] or default_model.gguf_path().is_file():
        return config
    print(f"mlxd: no model is configured: fetching the default model, {default_model.MODEL_NAME}", file=sys.stderr)
    if default_model.fetch(lambda line: print(f"mlxd:   {line}", file=sys.stderr, flush=True)) is None:
        return config
    return load_config(home=config.home)


def cmd_up(args: argparse.Namespace, config: Config) -> int:
    paths = config.paths
    pid = control.supervisord_pid(paths)
    if pid is not None:
        print(f"mlxd is already running (supervisord pid {pid}); see `mlxd status`")
        return exit_codes.OK
    config = with_default_model(config)
    for note in control.clean_stale(paths):
        print(f"mlxd: {note}", file=sys.stderr)
    for problems, code in ((preflight.model_problems(config), exit_codes.CONFIG),
                           (preflight.port_problems(config), exit_codes.STARTUP_FAILED)):
        if problems:
            print("\n".join(map(str, problems)), file=sys.stderr)
            return code
    _first_run(config)
    from .pull import pull_missing

    pull_missing(config)  # a configured repo not on disk yet: now, with its progress, not at its first request
    started_with.remember(config, config_path(config.home), paths)
    if not args.detach:
        return _run_foreground(config, args.timeout)
    pid = control.start_detached(config)
    print(f"supervisord started (pid {pid}); waiting for the engine...", file=sys.stderr)
    problem = _wait_ready(config, args.timeout, supervisord=pid)
    if problem is not None:
        print(f"\nmlxd: {problem}", file=sys.stderr)
        return 1
    _print_endpoint(config)
    return exit_codes.OK


def _first_run(config: Config) -> None:
    """A default config with a hint, and the key, on the very first `up`."""
    from mlxd.config import config_path, write_default_config
    from mlxd.gateway.keys import ensure_key

    path = config_path(config.home)
    if write_default_config(path):
        serving = (default_model.MODEL_NAME if default_model.MODEL_ID in config.models
                   else "the built-in demo model (random weights)")
        print(f"mlxd: wrote a default config to {path}: every alias serves {serving}.\n"
              f"      For another model add e.g. [models.qwen] repo = \"mlx-community/Qwen3-4B-Instruct-2507-4bit\" "
              f"there (see the comments in it).", file=sys.stderr)
    if list(config.models) == [DEMO_MODEL_ID]:
        print(f"mlxd: warning: {default_model.missing_hint()}", file=sys.stderr)
    if config.gateway.enabled:
        ensure_key(config.paths)


def _print_endpoint(config: Config) -> None:
    if config.gateway.enabled:
        base = config.gateway_url + "/v1"
        key_file = config.paths.key
        auth = f"-H \"Authorization: Bearer $(cat {key_file})\" "
        where = f"mlxd is serving: {base}   (key in {key_file})"
    else:
        base, auth = f"{config.engine_url}/v1", ""
        where = f"mlxd is serving (engine only): {base}"
    print(f"{where}\n"
          f"  curl -s {base}/chat/completions {auth}-H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"default\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'\n"
          f"  status: mlxd status    stop: Ctrl-C (or mlxd down)", flush=True)  # a log or pipe sees it now, not at exit


def _run_foreground(config: Config, timeout: float) -> int:
    """supervisord as our child: progress and the endpoint are printed, its
    exit status is ours (launchd's KeepAlive reads it), signals are passed on."""
    import signal
    import subprocess

    conf = control.prepare(config)
    proc = subprocess.Popen(control.supervisord_argv(conf))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _f: proc.send_signal(signum))
    print(f"supervisord started (pid {proc.pid}); waiting for the engine...", file=sys.stderr)
    problem = _wait_ready(config, timeout, alive=lambda: proc.poll() is None, supervisord=proc.pid)
    if problem is None:
        _print_endpoint(config)
    else:
        print(f"\nmlxd: {problem}", file=sys.stderr)
    while True:
        try:
            code = proc.wait()
            break
        except InterruptedError:
            continue
    started_with.forget(config.paths, writer_pid=os.getpid())  # as `mlxd down` does: nothing runs now
    return code


def cmd_down(config: Config) -> int:
    from mlxd.supervisor.supervisord_conf import stop_timeout_s

    stopped = control.shutdown(config.paths, timeout=stop_timeout_s(config))
    started_with.forget(config.paths)  # so that `status` and the next `up` no longer read the stopped stack's
    print("mlxd stopped" if stopped else "mlxd was not running")
    return exit_codes.OK


def cmd_restart(args: argparse.Namespace, config: Config) -> int:
    paths = config.paths
    if control.supervisord_pid(paths) is None:
        print("mlxd is not running; start it with `mlxd up`", file=sys.stderr)
        return 2
    if args.what == "engine":
        control.restart_engine(paths)
        print("engine restarted", file=sys.stderr)
        problem = _wait_ready(config, 300, supervisord=control.supervisord_pid(paths))
        if problem is not None:
            print(f"mlxd: {problem}", file=sys.stderr)
        return exit_codes.OK if problem is None else 1
    from mlxd.supervisor.supervisord_conf import stop_timeout_s

    control.shutdown(paths, timeout=stop_timeout_s(config))
    # Start again as `up` was started (its MLXD_* variables, unless set now), from mlxd.toml as it is now.
    started_with.use_overrides(getattr(args, "start_overrides", started_with.given_overrides(os.environ)))
    try:
        config = load_config(config_path(config.home), config.home)
    except ConfigError as exc:
        print(f"mlxd: {exc}", file=sys.stderr)
        return exit_codes.CONFIG
    return cmd_up(argparse.Namespace(detach=True, timeout=300.0), config)


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


def _autostart(config: Config) -> dict | None:
    from mlxd.launchd.service import status_summary

    try:
        return status_summary(config)
    except Exception:  # noqa: BLE001 - status never fails because of autostart
        return None


def cmd_status(args: argparse.Namespace, config: Config) -> int:
    st = replace(collect_status(config), autostart=_autostart(config), started_with=started_with.read(config.paths))
    print(json.dumps(st.to_json(), indent=2, default=str) if args.json else format_status(st))
    return STATUS_EXIT[st.overall]


def run_command(args: argparse.Namespace, config: Config) -> int:
    if args.command == "up":
        return cmd_up(args, config)
    if args.command == "down":
        return cmd_down(config)
    if args.command == "restart":
        return cmd_restart(args, config)
    if args.command == "status":
        return cmd_status(args, config)
    return exit_codes.USAGE
