"""Crash soak: many chat requests through the gateway while the engine is
killed again and again; every request's fate is recorded and checked.

It starts its own stack in a temp MLXD_HOME on free ports (supervisord +
engine + crash listener + gateway, with the Ollama stand-in as the
fallback: bench/crash_traffic.py), runs N client threads (the `openai`
package, through the gateway, with the key) that send a mix of streaming
and non-streaming chat requests, and a fault driver that kills the engine
about once per `--fault-every` requests, always tearing the stack down.

Faults: `abort@start`, `abort@token:N`, `abort@idle` (SIGABRT by fault
injection), `sigkill` and `sigabrt` (kill -KILL / kill -ABRT of
run/engine.pid from outside, at a random moment), `hang@token:N` (the
supervisor's stuck detection kills it), `raise@token:N` (an MLX exception:
exit 86), optionally `oom@token:N`; drawn in shuffled rounds (each kind
once per round). The gap between faults counts requests from the previous
fault, but the driver first waits for a healthy engine and then for
`min_between_faults` more answers, so each fault lands on a serving
engine. A fault-file fault stays until the crash is journaled
(state/crashes.jsonl grows), then the file is removed. For `abort@idle`
the clients are held back if the worker never idles by itself.

Per request: backend (engine or the stand-in), outcome (bench/crash_traffic.py
says which), latency.

`--max-concurrency N` writes `[engine] max_concurrency = N` into the
stack's config (default 1: one request at a time, the config as before);
above 1 the engine decodes the running requests as one batch, so a crash
hits several at once: use more clients than N (e.g. `--max-concurrency 4
--clients 6`). The monitor polls the engine's /health for
`max_observed_concurrency` (the most seen by each engine process), and the
report counts the crashes whose journal line names more than one request in
flight. Whether a journal line names every request in flight is checked
from the client side: each soak request's fingerprint is computed the way
the engine computes it (engine/core/jobs.py: its model id and messages), and a
stream that got engine content and then an explicit error belongs to the
crash nearest its end, which should name it (the exception: a stream whose
tokens were all generated but not yet sent when the engine died is cut but no
longer in flight, seen at max_concurrency 1 when the next request aborts at
its start); requests that fell back or failed around a crash without being
named (queued, or sent while the engine was already dead) are counted, not
judged.

On a slow CPU-only machine (2 cores) a batch's first step after a restart
prefills the 4 queued prompts at once (~0.7 s idle, more under the soak's
load) with no heartbeat, which the soak's stuck_grace_s of 1.5 s can take for
a hang: with --max-concurrency above 1 there, pass --stuck-grace-s 5, or
`restarts not caused by an injected fault` counts spurious `hang` kills.

  .venv/bin/python bench/soak.py [--requests 1000] [--max-seconds 900] [--clients 4] [--seed 1]
  .venv/bin/python bench/soak.py --max-concurrency 4 --clients 6 --requests 400 --fault-every 10 --stuck-grace-s 5

Report: Markdown on stdout, everything in bench/results/soak.json (--out).
Exit status 0 when nothing was lost or silently cut, 1 otherwise.
"""


from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
import requests as http

from mlxd.devkit.wait import wait_for
from mlxd.records import CrashRecord
from mlxd.reports import EngineHealth

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (tests/soak)
from benchkit import ROOT, RESULTS, percentile, write_json  # noqa: E402
from crash_traffic import GOOD, Settings, crash_stack, make_client, one_request, request_shape  # noqa: E402
from mlxd.devkit.stack import Stack  # noqa: E402

# kind -> (the journal class it should produce, spec maker; None: a signal from outside, SIGNALS)
FAULTS = {
    "abort@start": ("sigabrt", lambda rng: "abort@start"),
    "abort@token": ("sigabrt", lambda rng: f"abort@token:{rng.randint(2, 14)}"),
    "abort@idle": ("sigabrt", lambda rng: "abort@idle"),
    "sigkill": ("sigkill", None),
    "sigabrt": ("sigabrt", None),
    "hang@token": ("hang", lambda rng: f"hang@token:{rng.randint(2, 14)}"),
    "raise@token": ("mlx_error", lambda rng: f"raise@token:{rng.randint(2, 14)}"),
    "oom@token": ("metal_oom", lambda rng: f"oom@token:{rng.randint(2, 14)}"),
}
SIGNALS = {"sigkill": signal.SIGKILL, "sigabrt": signal.SIGABRT}  # sent to run/engine.pid from outside
DEFAULT_KINDS = ("abort@start", "abort@token", "abort@idle", "sigkill", "sigabrt", "hang@token", "raise@token")
MODEL_ID = "soak"  # the stack's model (crash_traffic.crash_stack), part of a request's fingerprint


@dataclass
class SoakSettings(Settings):
    """The stack's and the requests' settings, and the soak's own."""

    requests: int = 1000
    max_seconds: float = 900.0
    clients: int = 4
    fault_every: float = 20.0  # mean requests between faults (uniform in [0.5, 1.5] x this)
    min_between_faults: int = 3  # requests completed after the engine is healthy again, before the next fault
    kinds: tuple[str, ...] = DEFAULT_KINDS
    plan: tuple[str, ...] | None = None  # fixed fault kinds in order (then no more faults), else random
    fault_wait_s: float = 30.0  # a fault not journaled by then counts as not fired
    progress_every: int = 50


# --- the fault driver ---------------------------------------------------------------------

class Soak:
    """Owns the run's shared state: the request counter, the records, the client gate."""

    def __init__(self, s: SoakSettings, stack: Stack, say=print) -> None:
        self.s, self.stack, self.say = s, stack, say
        self.lock = threading.Lock()
        self.next_i = 0
        self.records: list[dict] = []
        self.faults: list[dict] = []
        self.modes: list[tuple[float, str]] = []  # supervision mode changes
        self.concurrency_by_pid: dict[int, int] = {}  # engine pid -> its /health max_observed_concurrency
        self.batch_sizes: Counter = Counter()  # /health batch_size samples
        self.stop = threading.Event()
        self.gate = threading.Event()  # set: clients may start requests
        self.gate.set()
        self.t_start = self.t_wall = self.deadline = self.wall_s = 0.0

    def completed(self) -> int:
        with self.lock:
            return len(self.records)

    def take_index(self) -> int | None:
        with self.lock:
            if self.next_i >= self.s.requests or time.monotonic() >= self.deadline or self.stop.is_set():
                return None
            self.next_i += 1
            return self.next_i - 1

    def client_loop(self) -> None:
        client, probe = make_client(self.stack.gateway_url, self.stack.key, self.s.request_timeout_s)
        try:
            while True:
                self.gate.wait(self.s.fault_wait_s)
                i = self.take_index()
                if i is None:
                    return
                rec = one_request(client, probe, i, self.s)
                rec["t"] = rec.pop("t0") - self.t_wall
                with self.lock:
                    self.records.append(rec)
                    n = len(self.records)
                if n % self.s.progress_every == 0:
                    self.progress(n)
        finally:
            client.close()

    def progress(self, n: int) -> None:
        with self.lock:
            c = Counter(r["outcome"] for r in self.records)
            b = Counter(r["backend"] for r in self.records if r["outcome"] in GOOD)
        restarts = len(self.stack.records())
        self.say(f"[{n:5d}/{self.s.requests}] {time.monotonic() - self.t_start:6.1f}s  engine {b['engine']}  "
                 f"ollama {b['ollama']}  failed {c['failed']}  stream_error {c['stream_error']}  "
                 f"silent {c['silent_truncation']}  faults {len(self.faults)}  restarts {restarts}")

    def monitor_loop(self) -> None:
        last = None
        tick = 0
        while not self.stop.wait(0.2):
            mode = self.stack.supervision().get("mode")
            if mode != last:
                self.modes.append((time.time() - self.t_wall, mode))
                last = mode
            tick += 1
            if tick % 2 == 0:  # /health every 0.4 s: how many requests the engine really runs at once
                self.sample_health()

    def sample_health(self) -> None:
        try:
            health = EngineHealth.from_json(http.get(self.stack.url + "/health", timeout=1).json())
        except (http.RequestException, ValueError):
            return
        if health is None or health.pid is None:
            return
        seen = health.max_observed_concurrency
        if seen is not None:
            self.concurrency_by_pid[health.pid] = max(seen, self.concurrency_by_pid.get(health.pid, 0))
        self.batch_sizes[health.batch_size] += 1

    def driver_loop(self) -> None:
        rng = random.Random(self.s.seed)
        plan = list(self.s.plan) if self.s.plan is not None else None
        deck: list[str] = []  # random kinds in shuffled rounds: every kind once per round
        last = 0  # completed requests when the previous fault was injected
        while not self.stop.is_set():
            if plan is not None and not plan:
                return
            if plan is None and not deck:
                deck = rng.sample(self.s.kinds, len(self.s.kinds))
            if not wait_for(self.stack.healthy, 120, 0.05, self.stop):
                if not self.stop.is_set():
                    self.say("fault driver: the engine is not healthy after 120 s; no more faults")
                return
            # The gap counts from the previous fault (the restart's fallback answers
            # included), but the engine answers a few requests between faults.
            gap = max(1, round(rng.uniform(0.5, 1.5) * self.s.fault_every))
            target = max(last + gap, self.completed() + self.s.min_between_faults)
            if not wait_for(lambda: self.completed() >= target, 1e9, 0.02, self.stop):
                return
            kind = plan.pop(0) if plan is not None else deck.pop()
            last = self.completed()
            self.faults.append(self.inject(kind, rng))

    def inject(self, kind: str, rng: random.Random) -> dict:
        expected, make_spec = FAULTS[kind]
        n_before = len(self.stack.records())
        f = {"kind": kind, "expected_class": expected, "at_request": self.completed(),
             "t": time.time() - self.t_wall}
        t0 = time.monotonic()
        journaled = lambda: len(self.stack.records()) > n_before  # noqa: E731
        if make_spec is None:  # SIGKILL / SIGABRT of the engine from outside, at a random moment
            time.sleep(rng.uniform(0.0, 0.5))
            pid = self.stack.engine_pid()
            sig = SIGNALS[kind]
            f["spec"] = f"{sig.name} {pid}"
            try:
                os.kill(int(pid), sig)
            except (OSError, TypeError, ValueError) as exc:
                f["error"] = repr(exc)
            fired = wait_for(journaled, self.s.fault_wait_s)
        else:
            f["spec"] = make_spec(rng)
            self.stack.fault_file.write_text(f["spec"])
            try:  # a request-bound fault needs a request: give up when the clients are done
                fired = wait_for(journaled, 2.0 if kind == "abort@idle" else self.s.fault_wait_s, stop=self.stop)
                if not fired and kind == "abort@idle" and not self.stop.is_set():  # never idle: hold clients back
                    self.gate.clear()
                    f["clients_held"] = True
                    fired = wait_for(journaled, self.s.fault_wait_s, stop=self.stop)
                fired = fired or wait_for(journaled, 1.0)
            finally:
                self.stack.fault_file.unlink(missing_ok=True)
                self.gate.set()
            f["cut_short"] = not fired and self.stop.is_set()  # the soak ended before it could fire
        f["journaled_s"] = round(time.monotonic() - t0, 3) if fired else None
        new = self.stack.records()[n_before:]
        f["journal_index"] = n_before if new else None
        f["class"] = new[0].klass if new else None
        f["matched"] = f["class"] == expected
        back = wait_for(self.stack.healthy, 120, 0.05, self.stop)
        f["healthy_again_s"] = round(time.monotonic() - t0, 3) if back else None
        self.say(f"fault {len(self.faults) + 1}: {f['spec']} -> {f['class'] or 'NOT JOURNALED'}"
                 f" (journaled {f['journaled_s']} s, healthy again {f['healthy_again_s']} s)")
        return f

    def run(self) -> None:
        self.t_start = time.monotonic()
        self.t_wall = time.time()
        self.deadline = self.t_start + self.s.max_seconds
        threads = [threading.Thread(target=self.client_loop, name=f"client-{k}", daemon=True)
                   for k in range(self.s.clients)]
        driver = threading.Thread(target=self.driver_loop, name="faults", daemon=True)
        monitor = threading.Thread(target=self.monitor_loop, name="monitor", daemon=True)
        for t in [*threads, driver, monitor]:
            t.start()
        try:
            for t in threads:
                t.join()
        finally:
            self.stop.set()
            self.gate.set()
            driver.join(self.s.fault_wait_s + 130)
            monitor.join(5)
        self.wall_s = time.monotonic() - self.t_start


# --- the report ----------------------------------------------------------------------------

def _mask(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", re.sub(r"[0-9a-f]{8,}", "X", text))[:120]


def request_fingerprint(s: Settings, i: int, model_id: str = MODEL_ID) -> str:
    """The engine's fingerprint of soak request i, as engine/core/jobs.py's
    Job.fingerprint makes it: the model id and the messages as the chat
    template gets them (no tools, prompt, template arguments or images).
    A journal fingerprint that matches no request shows a drift here."""
    from mlxd.engine.api.request_schema import ChatCompletionRequest

    _, max_tokens, prompt = request_shape(s.seed, i, s)
    req = ChatCompletionRequest(model="default", messages=[{"role": "user", "content": prompt}],
                                max_tokens=max_tokens, temperature=0.7)
    body = json.dumps([model_id, [m.for_template() for m in req.messages], req.tools_for_template(), None,
                       req.template_kwargs(), []], sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _end(r: dict, t_wall: float) -> float:
    return t_wall + r["t"] + r["latency_s"]


def crashes_in_flight(records: list[dict], journal: list[CrashRecord], faults: list[dict],
                      fingerprints: dict[str, int], t_wall: float) -> list[dict]:
    """Per crash: the requests its journal line names (soak indices, by
    fingerprint) and what the clients saw around it (pure). A stream that got
    engine content and then an explicit error was generating when the engine
    died: it belongs to the crash nearest its end, which must name it."""
    index = [k for k, j in enumerate(journal) if j.is_crash]
    crashes = [journal[k] for k in index]
    kind_of = {f["journal_index"]: f["kind"] for f in faults if f.get("journal_index") is not None}
    by_i = {r["i"]: r for r in records}
    cut: dict[int, list[int]] = {}  # crash -> streams cut mid-answer
    for r in records:
        if r["outcome"] == "stream_error" and r["backend"] == "engine" and crashes:
            start, end = t_wall + r["t"], _end(r, t_wall)
            after = [c for c, j in enumerate(crashes) if j.time >= start - 0.05] or [len(crashes) - 1]
            cut.setdefault(min(after, key=lambda c: abs(crashes[c].time - end)), []).append(r["i"])
    rows = []
    for c, j in enumerate(crashes):
        fps = [fp for _, fp in j.in_flight()]
        named = sorted(fingerprints[fp] for fp in fps if fp in fingerprints)
        around = sorted(r["i"] for r in records if t_wall + r["t"] < j.time <= _end(r, t_wall) + 1.0
                        and (r["outcome"] not in GOOD or r["backend"] == "ollama"))
        streams_cut = sorted(cut.get(c, []))
        rows.append({
            "time": j.time, "class": j.klass, "kind": kind_of.get(index[c]), "in_flight": len(fps),
            "named": named, "unmatched_fingerprints": len(fps) - len(named),
            "streams_cut": streams_cut, "streams_cut_not_named": [i for i in streams_cut if i not in named],
            "hit_not_named": [i for i in around if i not in named],
            "named_outcomes": dict(Counter(f"{by_i[i]['outcome']}/{by_i[i]['backend']}" for i in named
                                           if i in by_i)),
        })
    return rows


def summarize(records: list[dict], faults: list[dict], journal: list[CrashRecord], modes: list, wall_s: float,
              engine_healthy_at_end: bool, *, t_wall: float = 0.0, fingerprints: dict[str, int] | None = None,
              concurrency_by_pid: dict[int, int] | None = None, max_concurrency: int = 1) -> dict:
    """The soak's figures from the raw records (pure)."""
    outcomes = Counter(r["outcome"] for r in records)
    good = [r for r in records if r["outcome"] in GOOD]
    failures = Counter(f"{'stream' if r['stream'] else 'non-stream'} {r['outcome']}: {r.get('error_type')}"
                       f" {r.get('status') or ''} {r.get('code') or ''} {_mask(r.get('error', ''))}".strip()
                       for r in records if r["outcome"] not in GOOD)
    lat = [r["latency_s"] for r in records]
    lat_by = {b: [r["latency_s"] for r in good if r["backend"] == b] for b in ("engine", "ollama")}
    crashes = [j for j in journal if j.is_crash]
    degraded = [m for m in modes if m[1] == "degraded"]
    short = [r for r in good if not r["stream"] and r["backend"] == "engine" and r["finish_reason"] == "length"
             and (r.get("completion_tokens") or 0) < r["max_tokens"]]
    return {
        "requests": len(records),
        "streaming": sum(r["stream"] for r in records),
        "answered_by_engine": sum(r["backend"] == "engine" for r in good),
        "answered_by_fallback": sum(r["backend"] == "ollama" for r in good),
        "outcomes": dict(outcomes),
        "failed": sum(outcomes[o] for o in outcomes if o not in GOOD),
        "failures_grouped": dict(failures.most_common()),
        "non_streaming_lost": sum(1 for r in records if not r["stream"] and r["outcome"] not in GOOD),
        "silent_truncations": outcomes["silent_truncation"],
        "spliced_streams": outcomes["spliced"],
        "streams_failed_before_content": sum(1 for r in records if r["stream"] and r["outcome"] == "failed"),
        "streams_ended_with_explicit_error": outcomes["stream_error"],
        "streams_complete_without_done": sum(1 for r in records if r.get("no_done")),
        "engine_answers_shorter_than_max_tokens": len(short),
        "restarts_by_class": dict(Counter(j.klass for j in crashes)),
        "restarts": len(crashes),
        "faults_injected_by_kind": dict(Counter(f["kind"] for f in faults if not f.get("cut_short"))),
        "faults_not_journaled": sum(1 for f in faults if f["class"] is None and not f.get("cut_short")),
        "faults_cut_short_by_the_end": sum(1 for f in faults if f.get("cut_short")),
        "faults_misclassified": sum(1 for f in faults if f["class"] is not None and not f["matched"]),
        "restarts_not_injected": len(crashes) - sum(1 for f in faults if f["class"] is not None),
        "degraded_periods": len(degraded),
        "degraded_entries_in_journal": sum(1 for j in crashes if j.degraded),
        "recovery_s_median": statistics.median([f["healthy_again_s"] for f in faults if f["healthy_again_s"]] or [0]),
        "latency_s": {"p50": percentile(lat, 0.5), "p99": percentile(lat, 0.99), "max": max(lat, default=None)},
        "latency_s_by_backend": {b: {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99)} for b, v in lat_by.items()},
        "wall_s": round(wall_s, 2),
        "engine_healthy_at_end": engine_healthy_at_end,
        **concurrency_figures(records, faults, journal, fingerprints or {}, t_wall, concurrency_by_pid or {},
                              max_concurrency),
    }


def concurrency_figures(records: list[dict], faults: list[dict], journal: list[CrashRecord],
                        fingerprints: dict[str, int], t_wall: float, concurrency_by_pid: dict[int, int],
                        max_concurrency: int) -> dict:
    """How many requests each crash hit, and whether its journal line names them (pure)."""
    rows = crashes_in_flight(records, journal, faults, fingerprints, t_wall)
    cut = [i for row in rows for i in row["streams_cut"]]
    return {
        "max_concurrency": max_concurrency,
        "max_observed_concurrency": max(concurrency_by_pid.values(), default=None),
        "engine_processes_sampled": len(concurrency_by_pid),
        "crashes_by_requests_in_flight": dict(sorted(Counter(row["in_flight"] for row in rows).items())),
        "crashes_with_several_in_flight": sum(1 for row in rows if row["in_flight"] > 1),
        "crashes_with_several_in_flight_by_kind": dict(Counter(row["kind"] or row["class"] for row in rows
                                                               if row["in_flight"] > 1)),
        "journal_fingerprints_unmatched": sum(row["unmatched_fingerprints"] for row in rows),
        "streams_cut_mid_answer": len(cut),
        "streams_cut_not_named_by_their_crash": [(i, row["kind"] or row["class"]) for row in rows
                                                 for i in row["streams_cut_not_named"]],
        "hit_around_a_crash_not_named_by_kind": dict(Counter(row["kind"] or row["class"] for row in rows
                                                            for _ in row["hit_not_named"])),
        "named_requests_by_outcome": dict(sum((Counter(row["named_outcomes"]) for row in rows), Counter())),
        "crashes": rows,
    }


def markdown(m: dict) -> str:
    f = lambda v: "–" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    rows = [
        ("requests sent (streaming)", f"{m['requests']} ({m['streaming']})"),
        ("answered by the engine", m["answered_by_engine"]),
        ("answered by the fallback (Ollama stand-in)", m["answered_by_fallback"]),
        ("failed (any kind)", m["failed"]),
        ("**non-streaming requests lost** (goal 0)", m["non_streaming_lost"]),
        ("**silent truncations** (goal 0)", m["silent_truncations"]),
        ("spliced streams (goal 0)", m["spliced_streams"]),
        ("streams failed before any content", m["streams_failed_before_content"]),
        ("streams ended with an explicit error", m["streams_ended_with_explicit_error"]),
        ("streams with finish_reason but no [DONE]", m["streams_complete_without_done"]),
        ("restarts (journal)", f"{m['restarts']}: " + ", ".join(f"{k} {v}" for k, v in
                                                                  sorted(m["restarts_by_class"].items()))),
        ("restarts not caused by an injected fault", m["restarts_not_injected"]),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(m["faults_injected_by_kind"].items()))),
        ("faults not journaled / misclassified / cut short by the end",
         f"{m['faults_not_journaled']} / {m['faults_misclassified']} / {m['faults_cut_short_by_the_end']}"),
        ("degraded periods", m["degraded_periods"]),
        ("fault -> engine healthy again, median s", f(m["recovery_s_median"])),
        ("latency p50 / p99 / max s", " / ".join(f(m["latency_s"][k]) for k in ("p50", "p99", "max"))),
        ("latency p50 / p99 s, engine", " / ".join(f(m["latency_s_by_backend"]["engine"][k]) for k in ("p50", "p99"))),
        ("latency p50 / p99 s, fallback", " / ".join(f(m["latency_s_by_backend"]["ollama"][k]) for k in ("p50", "p99"))),
        ("max_concurrency / most seen at once (/health, over engine processes)",
         f"{m['max_concurrency']} / {f(m['max_observed_concurrency'])} ({m['engine_processes_sampled']} processes)"),
        ("crashes by requests named in flight (journal)",
         ", ".join(f"{k}: {v}" for k, v in m["crashes_by_requests_in_flight"].items()) or "–"),
        ("crashes with several requests in flight", f"{m['crashes_with_several_in_flight']} ("
         + ", ".join(f"{k} {v}" for k, v in sorted(m["crashes_with_several_in_flight_by_kind"].items())) + ")"),
        ("streams cut mid-answer / not named by their crash's journal line (goal 0)",
         f"{m['streams_cut_mid_answer']} / {len(m['streams_cut_not_named_by_their_crash'])}"),
        ("journal fingerprints matching no soak request", m["journal_fingerprints_unmatched"]),
        ("fell back or failed around a crash, not named (queued or sent to a dead engine)",
         ", ".join(f"{k} {v}" for k, v in sorted(m["hit_around_a_crash_not_named_by_kind"].items())) or "0"),
        ("named in flight, by outcome/backend",
         ", ".join(f"{k} {v}" for k, v in sorted(m["named_requests_by_outcome"].items())) or "–"),
        ("wall time s", f(m["wall_s"])),
        ("engine healthy at the end", m["engine_healthy_at_end"]),
    ]
    lines = ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    if m["failures_grouped"]:
        lines += ["", "| failure (grouped) | count |", "|---|---|"]
        lines += [f"| {k.replace('|', '/')} | {v} |" for k, v in m["failures_grouped"].items()]
    return "\n".join(lines)


def passed(m: dict) -> bool:
    return (m["non_streaming_lost"] == 0 and m["silent_truncations"] == 0 and m["spliced_streams"] == 0
            and m["engine_healthy_at_end"])


def run_soak(s: SoakSettings, home_root: Path | None = None, keep_home: bool = False, say=print) -> dict:
    """Start a stack, soak it, tear it down; returns {"summary", "settings", "faults", "journal", ...}."""
    with crash_stack(s, home_root, keep_home) as stack:
        say(f"stack up: gateway {stack.gateway_url}, engine {stack.url}, home {stack.home}")
        soak = Soak(s, stack, say)
        soak.run()
        stack.fault_file.unlink(missing_ok=True)
        healthy = bool(wait_for(stack.healthy, 60, 0.1))
        journal = stack.records()
    fingerprints = {request_fingerprint(s, r["i"]): r["i"] for r in soak.records}
    summary = summarize(soak.records, soak.faults, journal, soak.modes, soak.wall_s, healthy, t_wall=soak.t_wall,
                        fingerprints=fingerprints, concurrency_by_pid=soak.concurrency_by_pid,
                        max_concurrency=s.max_concurrency)
    slim_journal = [{k: j.to_json().get(k) for k in ("time", "class", "signal", "exit_code", "uptime_s", "restart_in_s",
                                           "degraded", "request_id", "requests")} for j in journal]
    return {"summary": summary, "settings": {**asdict(s), "model": str(s.model) if s.model else "demo-a"},
            "faults": soak.faults, "journal": slim_journal, "supervision_modes": soak.modes, "t_wall": soak.t_wall,
            "batch_size_samples": dict(sorted(soak.batch_sizes.items())),
            "records": sorted(soak.records, key=lambda r: r["i"]), "home": str(stack.home) if keep_home else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakSettings()
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--max-seconds", type=float, default=d.max_seconds)
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--fault-every", type=float, default=d.fault_every, help="mean requests between faults")
    ap.add_argument("--kinds", default=",".join(d.kinds), help=f"fault kinds, from {','.join(FAULTS)}")
    ap.add_argument("--stream-ratio", type=float, default=d.stream_ratio)
    ap.add_argument("--max-concurrency", type=int, default=d.max_concurrency,
                    help="[engine] max_concurrency (default 1); above 1 use more --clients than this")
    ap.add_argument("--loop-crashes", type=int, default=d.loop_crashes,
                    help="supervisor loop_crashes (default: never degrade); with --cooldown-s")
    ap.add_argument("--cooldown-s", type=float, default=d.cooldown_s)
    ap.add_argument("--stuck-grace-s", type=float, default=d.stuck_grace_s)
    ap.add_argument("--model", type=Path, help="an mlx-lm model folder (default: demo model a)")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    ap.add_argument("--keep-home", action="store_true", help="keep the temp MLXD_HOME (logs, journal)")
    args = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        ap.error(f"unknown fault kinds {unknown}; choose from {list(FAULTS)}")
    s = SoakSettings(requests=args.requests, max_seconds=args.max_seconds, clients=args.clients, seed=args.seed,
                 fault_every=args.fault_every, kinds=kinds, stream_ratio=args.stream_ratio,
                 loop_crashes=args.loop_crashes, cooldown_s=args.cooldown_s, stuck_grace_s=args.stuck_grace_s,
                 max_concurrency=args.max_concurrency, model=args.model)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    result = run_soak(s, keep_home=args.keep_home, say=say)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                         "openai": openai.__version__, "git": git.stdout.strip(),
                         "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_json(args.out, result)
    print(markdown(result["summary"]))
    print(f"\nresults: {args.out}")
    return 0 if passed(result["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
