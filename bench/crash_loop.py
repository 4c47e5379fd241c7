"""Crash-loop drill: an engine that crashes on every start, end to end on the
real stack, with figures.

It starts supervisord + crash listener + engine + LiteLLM gateway in a temp
MLXD_HOME on free loopback ports (bench/crash_traffic.py's crash_stack: the demo
model, the Ollama stand-in as the fallback), then:

  1. crash loop   writes the fault file `abort@idle,abort@boot` (SIGABRT of
                  the running engine, then of every new one at boot) and waits
                  for the listener to declare "degraded": the crashes it took
                  (goal: exactly [supervisor] loop_crashes), the time from
                  fault on to degraded, the backoffs, the spawns.
  2. cool-down    while degraded: N chat requests through the gateway (the
                  `openai` client, the home's key), every one must be answered
                  by the fallback (the stand-in's answers start with
                  "[ollama-standin:"); the CPU time (psutil user+system) of
                  supervisord and the listener (and any engine or runner) over
                  the window up to just before the probation start (goal: under
                  2 % of one core: no busy loop); no engine spawn in the window
                  (supervisord's log, the journal, the pid file).
  3. probation    the fault file is removed just before the cool-down ends;
                  the listener's probation start must bring the engine back:
                  time from the scheduled start to /health 200, then a request
                  through the gateway answered by the engine (not the fallback).
  4. operator     the fault again: a crash during probation is degraded at
                  once (1 crash); the fault removed, `mlxd restart engine`
                  (cli/operate.py): time to /health 200 and to an
                  engine answer through the gateway; the crash history cleared.

Supervisor settings: the documented defaults (core/config.py SupervisorConfig,
docs/CONFIG.md) except cooldown_s, shortened so the drill takes 1-2 minutes;
all used values are reported. Every process started is stopped by pid
(`mlxd down`, then SIGKILL of what is left), also on Ctrl-C and SIGTERM.

  .venv/bin/python bench/crash_loop.py            # cool-down 40 s, 20 requests: about 1.5 min
  .venv/bin/python bench/crash_loop.py --quick    # cool-down 15 s, 6 requests: under a minute

Progress on stderr, a Markdown table on stdout, everything in
bench/results/crash_loop.json (--out). Exit status 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import requests

from mlxd.config import SupervisorConfig
from mlxd.devkit.stack import MLXD, Stack
from mlxd.devkit.wait import wait_for
from mlxd.records import EnginePid
from mlxd.reports import EngineHealth

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (tests/soak)
from benchkit import RESULTS, machine_info, percentile, say, write_json  # noqa: E402
from crash_traffic import GOOD, Settings, crash_stack, make_client, one_request  # noqa: E402

DEFAULT_OUT = RESULTS / "crash_loop.json"
FAULT_SPEC = "abort@idle,abort@boot"  # the running engine aborts at once, every new one at boot
DOCUMENTED = SupervisorConfig()  # docs/CONFIG.md is generated from these defaults
SPAWNED = re.compile(r"spawned: 'engine' with pid (\d+)")
ROLES = (("listener", "mlxd.supervisor.listener"), ("runner", "mlxd.supervisor.engine_runner"),
         ("engine", "mlxd.cli engine"), ("gateway", "mlxd.cli gateway"))
WATCHED = ("supervisord", "listener", "runner", "engine")  # the cool-down CPU goal; the gateway is reported only


# --- observing the stack (reads files and /proc; costs supervisord nothing) --------------------

def spawn_pids(stack: Stack) -> list[int]:
    """Engine pids supervisord logged as spawned, oldest first."""
    try:
        return [int(p) for p in SPAWNED.findall((stack.paths.logs / "supervisord.log").read_text(errors="replace"))]
    except OSError:
        return []


def stack_processes(stack: Stack) -> dict[str, psutil.Process]:
    """supervisord and its live children by role."""
    try:
        sup = psutil.Process(int(stack.paths.supervisord_pid.read_text()))
        found = {"supervisord": sup}
        for child in sup.children(recursive=True):
            cmd = " ".join(child.cmdline())
            role = next((r for r, mark in ROLES if mark in cmd), None)
            if role and role not in found:
                found[role] = child
        return found
    except (OSError, ValueError, psutil.Error):
        return {}


def cpu_s(proc: psutil.Process) -> float | None:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return None


def mode(stack: Stack) -> str | None:
    return stack.supervision().get("mode")


def health(stack: Stack) -> EngineHealth | None:
    try:
        r = requests.get(stack.url + "/health", timeout=2)
        return EngineHealth.from_json(r.json()) if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def poll(cond: Callable[[], Any], timeout: float, interval: float = 0.05) -> tuple[Any, float | None]:
    """(the first truthy value, time.time() when seen) or (None, None) at the deadline."""
    value = wait_for(cond, timeout, interval)
    return value, (time.time() if value else None)


# --- the phases ---------------------------------------------------------------------------------

class Drill:
    def __init__(self, args: argparse.Namespace, stack: Stack, s: Settings) -> None:
        self.args, self.stack, self.s = args, stack, s
        self.raw: dict[str, Any] = {}
        self.client = None
        self.probe = None
        self.n_requests = 0

    def ask(self) -> dict:
        """One chat request through the gateway (crash_traffic: outcome, backend, latency)."""
        if self.client is None:
            self.client, self.probe = make_client(self.stack.gateway_url, self.stack.key, 60)
        rec = one_request(self.client, self.probe, self.n_requests, self.s)
        self.n_requests += 1
        return rec

    def crash_loop(self, name: str, expected: int) -> dict:
        """Fault on, wait for degraded: the journal's records of the way there."""
        st = self.stack
        n0, spawns0 = len(st.records()), len(spawn_pids(st))
        t_on = time.time()
        st.fault_file.write_text(FAULT_SPEC)
        say(f"{name}: fault on ({FAULT_SPEC}); waiting for degraded")
        _, t_seen = poll(lambda: mode(st) == "degraded", self.args.degraded_timeout_s)
        sup = st.supervision()
        recs = st.records()[n0:]
        first = next((i for i, r in enumerate(recs) if r.degraded), None)
        d = {"expected_crashes": expected, "fault_on_at": t_on, "degraded_seen_at": t_seen,
             "crashes_to_degraded": None if first is None else first + 1,
             "time_to_degraded_s": None if first is None else round(recs[first].handled_at - t_on, 3),
             "time_to_degraded_seen_s": None if t_seen is None else round(t_seen - t_on, 3),
             "classes": [r.klass for r in recs], "restart_in_s": [r.restart_in_s for r in recs],
             "crash_times": [r.time for r in recs], "spawns": len(spawn_pids(st)) - spawns0,
             "restart_at": sup.get("restart_at")}
        say(f"{name}: {'degraded' if t_seen else 'NOT degraded'} after {d['crashes_to_degraded']} crashes "
            f"(expected {expected}), {d['time_to_degraded_s']} s; backoffs {d['restart_in_s']}")
        return d

    def cooldown(self, restart_at: float) -> dict:
        """While degraded: fallback requests, CPU of the supervision processes, no spawns."""
        st = self.stack
        status = st.mlxd("status", "--json", timeout=30)  # before the window: XML-RPC wakes supervisord
        overall = json.loads(status.stdout or "{}").get("overall")
        end = restart_at - self.args.margin_s
        procs = stack_processes(st)
        spawns0, n0 = spawn_pids(st), len(st.records())
        runner0 = EnginePid.read(st.paths.engine_pid)
        t0, cpu0 = time.monotonic(), {r: cpu_s(p) for r, p in procs.items()}
        reqs, modes = [], []
        for _ in range(self.args.requests):
            if time.time() > end - 0.5:
                break
            reqs.append(self.ask())
            modes.append(mode(st))
        say(f"cool-down: {len(reqs)} requests through the gateway: "
            f"{sum(r['backend'] == 'ollama' and r['outcome'] in GOOD for r in reqs)} answered by the fallback")
        while time.time() < end:  # the window is a span of time: watch the mode meanwhile (a file read)
            modes.append(mode(st))
            time.sleep(min(0.5, max(0.0, end - time.time())))
        window = time.monotonic() - t0
        cpu1 = {r: cpu_s(p) for r, p in procs.items()}
        cpu = {r: {"pid": procs[r].pid, "cpu_s": round(cpu1[r] - cpu0[r], 3)}
               for r in procs if cpu0[r] is not None and cpu1[r] is not None}
        spawned = spawn_pids(st)[len(spawns0):]
        return {"status_overall": overall, "status_exit": status.returncode, "window_s": round(window, 3),
                "cpu": cpu, "spawns": len(spawned), "spawned_pids": spawned, "journal_records": len(st.records()) - n0,
                "engine_pid_file_changed": EnginePid.read(st.paths.engine_pid) != runner0,
                "modes_seen": sorted(set(m for m in modes if m)), "requests": reqs}

    def wait_engine_back(self, started_at: float) -> dict:
        """/health 200, then a gateway request answered by the engine (bounded)."""
        h, t_h = poll(lambda: health(self.stack), self.args.recovery_timeout_s)
        d: dict[str, Any] = {"healthy_s": None if t_h is None else round(t_h - started_at, 3)}
        if h:
            d.update(pid=h.pid, load_s=h.load_s, process_started_at=h.process_started_at)
        tries = []
        deadline = time.monotonic() + self.args.recovery_timeout_s
        while h and time.monotonic() < deadline:
            rec = self.ask()
            tries.append(rec)
            if rec["outcome"] in GOOD and rec["backend"] == "engine":
                d["engine_answer_s"] = round(time.time() - started_at, 3)
                break
            time.sleep(0.1)
        d.update(gateway_tries=tries, answered_by_engine=bool(tries) and tries[-1]["backend"] == "engine"
                 and tries[-1]["outcome"] in GOOD)
        sup = self.stack.supervision()
        d.update(mode_after=sup.get("mode"), probation=sup.get("probation"),
                 crash_history_after=len(sup.get("crash_times") or ()))
        return d

    def probation(self, restart_at: float) -> dict:
        """Fault off just before the cool-down ends; the listener's probation start."""
        st = self.stack
        n0 = len(st.records())
        st.fault_file.unlink(missing_ok=True)
        t_off = time.time()
        say(f"probation: fault off {restart_at - t_off:.1f} s before the scheduled start")
        d = self.wait_engine_back(restart_at)
        d.update(fault_off_before_start_s=round(restart_at - t_off, 3), crashes_after=len(st.records()) - n0)
        if d.get("process_started_at"):
            d["probation_start_late_s"] = round(d["process_started_at"] - restart_at, 3)
        say(f"probation: engine healthy {d['healthy_s']} s after the scheduled start, "
            f"answers through the gateway at {d.get('engine_answer_s')} s")
        return d

    def operator_restart(self) -> dict:
        """Degraded again (a crash in probation), then fault off and `mlxd restart engine`."""
        st = self.stack
        loop = self.crash_loop("operator", 1)
        st.fault_file.unlink(missing_ok=True)
        t0 = time.time()
        say("operator: fault off; mlxd restart engine")
        proc = subprocess.Popen([*MLXD, "restart", "engine"], env=st.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            d = self.wait_engine_back(t0)
            out, _ = proc.communicate(timeout=self.args.recovery_timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        d.update(loop=loop, command_rc=proc.returncode, command_output=(out or "")[-800:])
        say(f"operator: engine healthy {d['healthy_s']} s after the restart command, "
            f"answers through the gateway at {d.get('engine_answer_s')} s (command exit {proc.returncode})")
        return d


# --- figures, goals, report -----------------------------------------------------------------------

def summarize(raw: dict[str, Any], sup: dict[str, Any], requested: int, cpu_goal_pct: float) -> dict[str, Any]:
    """The drill's figures and the goals missed, from the raw phases (pure)."""
    loop, cool = raw.get("crash_loop") or {}, raw.get("cooldown") or {}
    reqs = cool.get("requests", [])
    fallback = [r for r in reqs if r["outcome"] in GOOD and r["backend"] == "ollama"]
    watched = sum(v["cpu_s"] for k, v in cool.get("cpu", {}).items() if k in WATCHED)
    window = cool.get("window_s") or 0.0
    m = {
        "crashes_to_degraded": loop.get("crashes_to_degraded"), "loop_crashes": sup["loop_crashes"],
        "time_to_degraded_s": loop.get("time_to_degraded_s"), "backoffs_s": loop.get("restart_in_s"),
        "crash_classes": sorted(set(loop.get("classes", []))), "spawns_to_degraded": loop.get("spawns"),
        "status_overall_degraded": cool.get("status_overall"), "cooldown_window_s": window or None,
        "spawns_during_cooldown": cool.get("spawns"), "crashes_during_cooldown": cool.get("journal_records"),
        "modes_during_cooldown": cool.get("modes_seen"),
        "fallback_sent": len(reqs), "fallback_answered": len(fallback), "fallback_failed": len(reqs) - len(fallback),
        "fallback_latency_p50_s": percentile([r["latency_s"] for r in fallback], 0.5),
        "fallback_latency_max_s": max((r["latency_s"] for r in fallback), default=None),
        "cpu_by_process_s": {k: v["cpu_s"] for k, v in cool.get("cpu", {}).items()},
        "cpu_watched_s": round(watched, 3) if cool else None,
        "cpu_watched_pct_of_core": round(100 * watched / window, 3) if window else None,
    }
    for phase in ("probation", "operator"):
        p = raw.get(phase)
        if p is not None:
            m[phase] = {k: p.get(k) for k in ("healthy_s", "engine_answer_s", "load_s", "answered_by_engine",
                                              "mode_after", "probation", "crash_history_after", "crashes_after",
                                              "probation_start_late_s", "command_rc")}
            m[phase]["fallback_answers_first"] = sum(r["backend"] == "ollama" for r in p.get("gateway_tries", []))
    if raw.get("operator"):
        m["operator"]["crashes_to_degraded"] = raw["operator"]["loop"].get("crashes_to_degraded")
    m["failures"] = goals_missed(m, requested, cpu_goal_pct)
    return m


def goals_missed(m: dict[str, Any], requested: int, cpu_goal_pct: float) -> list[str]:
    checks = [
        (m["crashes_to_degraded"] == m["loop_crashes"],
         f"degraded after {m['crashes_to_degraded']} crashes, not loop_crashes = {m['loop_crashes']}"),
        (m["crash_classes"] == ["sigabrt"], f"crash classes {m['crash_classes']}, not sigabrt"),
        (m["status_overall_degraded"] == "degraded", f"mlxd status said {m['status_overall_degraded']!r}"),
        (m["spawns_during_cooldown"] == 0 and m["crashes_during_cooldown"] == 0
         and m["modes_during_cooldown"] == ["degraded"],
         f"cool-down not quiet: {m['spawns_during_cooldown']} spawns, {m['crashes_during_cooldown']} crashes, "
         f"modes {m['modes_during_cooldown']}"),
        (m["fallback_sent"] == requested and m["fallback_failed"] == 0,
         f"while degraded {m['fallback_answered']} of {requested} requests answered by the fallback"),
        (m["cpu_watched_pct_of_core"] is not None and m["cpu_watched_pct_of_core"] < cpu_goal_pct,
         f"supervision CPU {m['cpu_watched_pct_of_core']} % of a core during the cool-down (goal < {cpu_goal_pct})"),
    ]
    p = m.get("probation") or {}
    checks.append((p.get("healthy_s") is not None and p.get("answered_by_engine") and p.get("crashes_after") == 0,
                   f"no clean recovery by the probation start: {p}"))
    o = m.get("operator")
    if o is not None:
        checks.append((o["crashes_to_degraded"] == 1, f"a crash in probation took {o['crashes_to_degraded']} "
                                                       "crashes to degrade, not 1"))
        checks.append((o["command_rc"] == 0 and o["healthy_s"] is not None and o["answered_by_engine"]
                       and o["mode_after"] == "running" and o["crash_history_after"] == 0,
                       f"no clean recovery by `mlxd restart engine`: {o}"))
    return [why for ok, why in checks if not ok]


def markdown(m: dict[str, Any], sup: dict[str, Any], cpu_goal_pct: float) -> str:
    f = lambda v: "–" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    ok = lambda c: "ok" if c else "**MISSED**"  # noqa: E731
    p, o = m.get("probation") or {}, m.get("operator")
    rows = [
        ("crashes until degraded", f"{f(m['crashes_to_degraded'])} ({', '.join(m['crash_classes'])})",
         f"= loop_crashes {m['loop_crashes']}", ok(m["crashes_to_degraded"] == m["loop_crashes"])),
        ("fault on -> degraded, s", f(m["time_to_degraded_s"]), "", f"backoffs {m['backoffs_s']}"),
        ("engine spawns / crashes during the cool-down", f"{f(m['spawns_during_cooldown'])} / "
         f"{f(m['crashes_during_cooldown'])} in {f(m['cooldown_window_s'])} s", "0 / 0",
         ok(m["spawns_during_cooldown"] == 0 and m["crashes_during_cooldown"] == 0)),
        ("`mlxd status` while degraded", f(m["status_overall_degraded"]), "degraded",
         ok(m["status_overall_degraded"] == "degraded")),
        ("requests while degraded: answered by fallback / failed", f"{m['fallback_answered']} / "
         f"{m['fallback_failed']}", "all / 0", ok(m["fallback_failed"] == 0 and m["fallback_answered"])),
        ("fallback latency p50 / max, s", f"{f(m['fallback_latency_p50_s'])} / {f(m['fallback_latency_max_s'])}",
         "", ""),
        ("CPU in the cool-down: supervisord + listener", f"{f(m['cpu_watched_s'])} s = "
         f"{f(m['cpu_watched_pct_of_core'])} % of a core", f"< {cpu_goal_pct} %",
         ok((m["cpu_watched_pct_of_core"] or 1e9) < cpu_goal_pct)),
        ("CPU by process, s", ", ".join(f"{k} {v:.2f}" for k, v in m["cpu_by_process_s"].items()), "",
         "gateway: served the requests"),
        ("probation start -> engine healthy / answers via gateway, s",
         f"{f(p.get('healthy_s'))} / {f(p.get('engine_answer_s'))} (load {f(p.get('load_s'))})", "engine answers",
         ok(p.get("answered_by_engine") and p.get("crashes_after") == 0)),
    ]
    if o is not None:
        rows += [
            ("crash in probation -> degraded after", f"{f(o['crashes_to_degraded'])} crash(es)", "1",
             ok(o["crashes_to_degraded"] == 1)),
            ("`mlxd restart engine` -> engine healthy / answers via gateway, s",
             f"{f(o['healthy_s'])} / {f(o['engine_answer_s'])} (load {f(o['load_s'])}; mode {o['mode_after']})",
             "engine answers", ok(o["answered_by_engine"] and o["command_rc"] == 0 and o["mode_after"] == "running")),
        ]
    documented = DOCUMENTED.model_dump()
    same = ", ".join(f"{k} {v}" for k, v in sup.items() if v == documented.get(k))
    changed = ", ".join(f"{k} {v} (documented {documented.get(k)})" for k, v in sup.items() if v != documented.get(k))
    lines = [f"[supervisor] used: {changed or 'all as documented'}; as documented: {same}", "",
             "| figure | value | goal | |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines += ["", "All goals met." if not m["failures"] else "Goals missed:\n" + "\n".join(f"- {x}"
                                                                                           for x in m["failures"])]
    return "\n".join(lines)


# --- run ----------------------------------------------------------------------------------------

def stack_settings(args: argparse.Namespace) -> Settings:
    """The stack's settings: the documented supervisor defaults, the cool-down shortened."""
    return Settings(loop_crashes=args.loop_crashes, loop_window_s=DOCUMENTED.loop_window_s,
                         cooldown_s=args.cooldown_s, backoff_base_s=DOCUMENTED.backoff_base_s,
                         backoff_cap_s=DOCUMENTED.backoff_cap_s, healthy_reset_s=DOCUMENTED.healthy_reset_s,
                         model=args.model, seed=args.seed)


def machine() -> dict[str, Any]:
    try:
        info = machine_info()
    except Exception as exc:  # noqa: BLE001 - the drill's figures do not depend on it
        info = {"machine_info_error": repr(exc), "cpu_count": os.cpu_count()}
    import openai

    info["openai"] = openai.__version__
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole drill; writes args.out (when set) and returns everything."""
    s = stack_settings(args)
    info = machine()
    t0 = time.monotonic()
    with crash_stack(s, args.home_root, args.keep_home) as stack:
        drill = Drill(args, stack, s)
        sup = stack.config.supervisor.model_dump()  # what the stack runs with
        say(f"stack up in {time.monotonic() - t0:.1f} s: gateway {stack.gateway_url}, engine {stack.url}, "
            f"home {stack.home}")
        try:
            drill.raw["crash_loop"] = loop = drill.crash_loop("crash loop", s.loop_crashes)
            if loop["degraded_seen_at"] is not None and loop["restart_at"]:
                drill.raw["cooldown"] = drill.cooldown(loop["restart_at"])
                drill.raw["probation"] = drill.probation(loop["restart_at"])
                if not args.no_operator and drill.raw["probation"]["healthy_s"] is not None:
                    drill.raw["operator"] = drill.operator_restart()
            journal = stack.records()
        finally:
            if drill.client is not None:
                drill.client.close()
    figures = summarize(drill.raw, sup, args.requests, args.cpu_goal_pct)
    result = {"figures": figures, "passed": not figures["failures"],
              "settings": {"supervisor_used": sup, "supervisor_documented": DOCUMENTED.model_dump(),
                           "engine_stuck_grace_s": s.stuck_grace_s, "fault": FAULT_SPEC, "requests": args.requests, "cpu_goal_pct": args.cpu_goal_pct,
                           "margin_s": args.margin_s, "quick": args.quick, "seed": args.seed,
                           "model": str(args.model) if args.model else "demo-a",
                           "operator_phase": not args.no_operator},
              "raw": drill.raw, "journal": [{k: j.to_json().get(k) for k in ("time", "handled_at", "class", "signal", "pid",
                                                                    "uptime_s", "restart_in_s", "degraded")}
                                            for j in journal],
              "wall_s": round(time.monotonic() - t0, 1), "home": str(stack.home) if args.keep_home else None,
              "machine": {**info, "loadavg_at_end": list(os.getloadavg())}}
    if args.out:
        write_json(args.out, result)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="cool-down 15 s and 6 requests (unless given)")
    ap.add_argument("--cooldown-s", type=float, help=f"[supervisor] cooldown_s (40; documented "
                                                     f"{DOCUMENTED.cooldown_s})")
    ap.add_argument("--requests", type=int, help="chat requests while degraded (20)")
    ap.add_argument("--loop-crashes", type=int, default=DOCUMENTED.loop_crashes)
    ap.add_argument("--cpu-goal-pct", type=float, default=2.0, help="supervision CPU goal, %% of one core")
    ap.add_argument("--margin-s", type=float, default=1.0, help="fault off this long before the probation start")
    ap.add_argument("--degraded-timeout-s", type=float, default=180.0)
    ap.add_argument("--recovery-timeout-s", type=float, default=90.0)
    ap.add_argument("--no-operator", action="store_true", help="skip the `mlxd restart engine` phase")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", type=Path, help="an mlx-lm model folder (default: demo model a)")
    ap.add_argument("--home-root", type=Path, help="where the temp MLXD_HOME goes")
    ap.add_argument("--keep-home", action="store_true", help="keep the temp MLXD_HOME (logs, journal)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    args.cooldown_s = args.cooldown_s if args.cooldown_s is not None else (15.0 if args.quick else 40.0)
    args.requests = args.requests if args.requests is not None else (6 if args.quick else 20)
    return args


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    # SIGTERM, and SIGINT even when started with it ignored (from a script, in the background): stop cleanly.
    previous = {sig: signal.signal(sig, h) for sig, h in ((signal.SIGTERM, _on_sigterm),
                                                          (signal.SIGINT, signal.default_int_handler))}
    try:
        result = run(args)
    except KeyboardInterrupt:
        say("interrupted: the stack was stopped")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(markdown(result["figures"], result["settings"]["supervisor_used"], args.cpu_goal_pct))
    say(f"\nresults: {args.out} ({result['wall_s']:.0f} s)")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
