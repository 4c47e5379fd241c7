"""Recovery benchmark: SIGABRT -> the engine answering again, under the real
supervisor (supervisord + runner + crash listener), split into phases, and
what the crashes cost the clients of the gateway.

  detection  kill -> the crash listener has handled the exit
  backoff    the listener's chosen delay (0 after a healthy run)
  spawn      end of backoff -> the new engine process exists
  load       engine process start -> ready, split by the engine's own timings into
               start    process start -> its worker thread (interpreter, imports, the app)
               mlx_lm   mlx-lm's import (transformers with it)
               index    the prompt cache's disk index read
               weights  the model's weights loaded
               rest     the remainder (MLX's memory limit, the first /health answer)
  total      kill -> /health 200 from the new process

Each crash follows a healthy run (healthy_reset_s is set short), which is
the case the goal is about: <= 1 s plus model load. The SIGABRT is a real
signal sent to the engine's pid at a random moment.

Two arms, one stack each, in one run: `standby` (the default: the standby
keeper's imported process takes over; each crash waits until one is ready,
as after any healthy run longer than its imports) and `afresh`
(`standby_engine = false`: the runner starts a new interpreter).

Meanwhile one client sends chat requests (non-streaming and streaming, in
turn) through the gateway, with the Ollama stand-in as the fallback, and
counts how they ended: answered by the engine, by the fallback, failed
(no complete answer; goal 0), or -- streams only -- cut by the crash after
tokens had been sent, with an explicit error (no [DONE]); nothing can save
those without splicing two answers, which the gateway never does.

  .venv/bin/python bench/recovery.py [--crashes 10] [--model PATH] [--arms standby,afresh] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests

from mlxd.devkit.stack import Stack
from mlxd.devkit.wait import wait_for
from mlxd.records import StandbyFile
from mlxd.reports import EngineHealth

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py, tests)
from benchkit import RESULTS, BenchError, machine_info, say, write_json  # noqa: E402
from crash_traffic import GOOD, Settings, crash_stack, make_client, one_request  # noqa: E402

HEALTHY_RUN_S = 1.5
PHASES = ["detection_s", "backoff_s", "spawn_s", "load_s", "start_s", "mlx_lm_s", "index_s", "weights_s", "rest_s",
          "total_s"]


def health(url: str) -> EngineHealth | None:
    try:
        r = requests.get(url + "/health", timeout=1)
        return EngineHealth.from_json(r.json()) if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


class Traffic:
    """One client thread through the gateway; owns its records."""

    def __init__(self, stack: Stack, settings: Settings) -> None:
        self.stack, self.s = stack, settings
        self.records: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="recovery-traffic", daemon=True)

    def _loop(self) -> None:
        client, probe = make_client(self.stack.gateway_url, self.stack.key, self.s.request_timeout_s)
        i = 0
        while not self.stop.is_set():
            self.records.append(one_request(client, probe, i, self.s))
            i += 1

    def __enter__(self) -> "Traffic":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(self.s.request_timeout_s + 5)


def outcome_counts(records: list[dict]) -> dict[str, int]:
    """How the requests ended (pure): failed = no complete answer."""
    c = Counter()
    for r in records:
        o = r.get("outcome")
        if o in GOOD:
            c["answered_by_" + (r.get("backend") or "engine")] += 1
        elif o == "stream_error":
            c["stream_cut_explicit"] += 1
        else:
            c["failed"] += 1
            c["failed_" + str(o)] += 1
    c["sent"] = len(records)
    return dict(c)


def load_parts(load_s: float, timings: dict[str, float]) -> dict[str, float]:
    """The engine's load split by its own timings (pure); an engine without them: all of it is rest."""
    start, mlx_lm, index, weights = (timings.get(k, 0.0) for k in ("start_to_worker_s", "mlx_lm_import_s",
                                                                      "prompt_cache_index_s", "last_load_s"))
    return {"start_s": start, "mlx_lm_s": mlx_lm, "index_s": index, "weights_s": weights,
            "rest_s": load_s - start - mlx_lm - index - weights}


def run_arm(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    standby = arm == "standby"
    settings = Settings(healthy_reset_s=HEALTHY_RUN_S, model=args.model, min_tokens=8, max_tokens=32,
                        stream_ratio=0.5, request_timeout_s=120.0, standby_engine=standby, standby_delay_s=0.0)
    rng = random.Random(args.seed)
    rows: list[dict] = []
    say(f"recovery, {arm}: starting the stack (mlxd up --detach) with the Ollama stand-in as fallback")
    with crash_stack(settings, args.home_root, args.keep_home) as stack:
        if args.keep_home:
            say(f"MLXD_HOME kept: {stack.home}")
        with Traffic(stack, settings) as traffic:
            for i in range(args.crashes):
                # A healthy run first, then a random moment (benchmark pacing, not synchronisation).
                time.sleep(HEALTHY_RUN_S + 0.2 + rng.uniform(0, 0.5))
                if standby and not wait_for(lambda: (r := StandbyFile.read(stack.paths.standby)) and r.ready, 60):
                    raise BenchError("no standby engine ready within 60 s")
                # The engine may be busy with the traffic's first request (on a GPU, a fresh process compiles
                # its kernels meanwhile): wait for it to answer /health, as a crash's moment is random anyway.
                old = wait_for(lambda: health(stack.url), 120, 0.1)
                if not old:
                    raise BenchError("engine not healthy before the crash (120 s)")
                n_records = len(stack.records())
                t_kill = time.time()
                os.kill(old.pid, signal.SIGABRT)
                new = wait_for(lambda: (h := health(stack.url)) and h.pid != old.pid and h, 120, 0.005)
                if not new:
                    raise BenchError("the engine did not come back within 120 s")
                t_back = time.time()
                rec = wait_for(lambda: (r := stack.records()) and len(r) > n_records and r[-1], 30, 0.005)
                if not rec:
                    raise BenchError("the crash was not journaled")
                load_s = new.ready_at - new.process_started_at
                row = {"detection_s": rec.handled_at - t_kill, "backoff_s": rec.restart_in_s,
                       "spawn_s": new.process_started_at - (rec.handled_at + rec.restart_in_s),
                       "load_s": load_s, **load_parts(load_s, new.timings), "total_s": t_back - t_kill,
                       "class": rec.klass}
                rows.append(row)
                say(f"{arm} crash {i + 1}/{args.crashes}: " + "  ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
                    + f"  (requests so far: {len(traffic.records)})")
            time.sleep(HEALTHY_RUN_S)  # let the last request in flight finish on the new engine
        traffic_records = traffic.records
    median = {k: statistics.median(r[k] for r in rows) for k in PHASES}
    return {"crashes": rows, "median": median,
            "total_minus_weights_s": median["total_s"] - median["weights_s"],
            "requests": outcome_counts(traffic_records),
            "request_records": [{k: r.get(k) for k in ("i", "stream", "outcome", "backend", "latency_s", "error")}
                                for r in traffic_records]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = {"machine": machine_info(), "settings": {"crashes": args.crashes, "healthy_run_s": HEALTHY_RUN_S,
                                                         "model": str(args.model or "demo-a"), "seed": args.seed},
              "arms": {arm: run_arm(args, arm) for arm in args.arms}}
    write_json(args.out, result)
    return result


def markdown(res: dict[str, Any]) -> str:
    arms = res["arms"]
    lines = ["| phase | " + " | ".join(f"{a}: median (s) | min | max" for a in arms) + " |",
             "|---|" + "---:|---:|---:|" * len(arms)]
    for k in PHASES:
        cells = []
        for arm in arms.values():
            vals = [r[k] for r in arm["crashes"]]
            cells.append(f"{arm['median'][k]:.3f} | {min(vals):.3f} | {max(vals):.3f}")
        lines.append(f"| {k[:-2]} | " + " | ".join(cells) + " |")
    for name, arm in arms.items():
        c = arm["requests"]
        lines += ["", f"{name}: crash -> serving {arm['median']['total_s']:.3f} s, of which the weights "
                      f"{arm['median']['weights_s']:.3f} s: the rest {arm['total_minus_weights_s']:.3f} s (goal <= 1 s); "
                      f"requests through the gateway during the {len(arm['crashes'])} crashes: {c.get('sent', 0)} sent, "
                      f"{c.get('answered_by_engine', 0)} answered by the engine, {c.get('answered_by_ollama', 0)} by the "
                      f"fallback, {c.get('failed', 0)} failed (goal 0), {c.get('stream_cut_explicit', 0)} streams cut "
                      "mid-answer with an explicit error"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--crashes", type=int, help="SIGABRTs (default 10; --quick 3)")
    ap.add_argument("--model", type=Path, help="model folder (default: the built-in demo model a)")
    ap.add_argument("--arms", default="standby,afresh",
                    help="standby: the standby engine takes over (the default config); afresh: standby_engine = false")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--home-root", type=Path, help="where the temporary MLXD_HOME goes")
    ap.add_argument("--keep-home", action="store_true", help="keep the temporary MLXD_HOME (logs, journal)")
    ap.add_argument("--out", type=Path, default=RESULTS / "recovery.json")
    args = ap.parse_args(argv)
    args.crashes = args.crashes or (3 if args.quick else 10)
    args.arms = [a for a in args.arms.split(",") if a]
    if not args.arms or set(args.arms) - {"standby", "afresh"}:
        ap.error("--arms: standby and/or afresh")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        res = run(args)
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    print("\n" + markdown(res))
    print(f"results: {args.out}")
    return 0 if all(arm["requests"].get("failed", 0) == 0 for arm in res["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
