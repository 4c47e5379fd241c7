#!/usr/bin/env python3
"""Several agents through the whole service while the engine is killed at a
set interval, against the same agents with no fault, in one run (issue 36).

Each arm starts the real stack in a new home (supervisord, the crash
listener, the engine, the gateway; the Ollama stand-in as the fallback:
bench/crash_traffic.py's crash_stack). --agents conversations run together
through the gateway with the `openai` client, as agents do: each has its own
system prompt of --system-tokens tokens, then --turns turns; a turn adds a
user message of --turn-tokens tokens, streams (or not: --no-stream) an
answer of --max-tokens greedy tokens and appends it; the next is sent at
once. A turn that fails is sent again, as an agent's client retries (up to
--attempts times): a stream that had started when the engine died ends with
an explicit error (mlxd never splices two answers), a request that had not
is carried across the restart by the gateway. In the `faults` arm a thread
sends SIGABRT to the engine every --fault-every-s seconds (what Metal's
check_error does) and times each restart until /health says ok.

Reported per arm: turns completed a minute (and faults / no faults), turns
lost (every attempt failed), failed attempts by kind (before the answer
started: should be none; mid-stream: explicit errors), turns answered by
Ollama, the cached share of each agent's first turn after a restart, restart
times, and requests quarantined.

  .venv/bin/python bench/fault_replay.py --agents 2 --system-tokens 600 --turn-tokens 100 --turns 4 \\
      --max-tokens 16 --fault-every-s 5        # CPU-sized, the demo model
  bash bench/gpu_run.sh faults                  # the 8B demo: 4 agents, 12k-token prompts, a SIGABRT every 120 s

Progress to stderr, a Markdown summary to stdout, every turn to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import RESULTS, demo_model, machine_info, median, say, write_json  # noqa: E402
from concurrency import add_agent_args, agent_prompts, token_counter  # noqa: E402
from crash_traffic import STANDIN_MARK, Settings, crash_stack  # noqa: E402

OUT = RESULTS / "fault_replay.json"


@dataclass
class Turn:
    agent: int
    turn: int
    t0: float
    end_s: float
    attempts: int
    ok: bool
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    by_ollama: bool = False
    after_restart: bool = False  # the engine was killed since this agent's previous answer
    failures: list[str] = field(default_factory=list)  # "before_answer: ..." or "mid_stream: ..."


class Killer(threading.Thread):
    """SIGABRT to the engine every `every_s`; each restart timed until /health is ok."""

    def __init__(self, stack: Any, every_s: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.stack, self.every_s, self.stop = stack, every_s, stop
        self.kills: list[float] = []  # perf_counter times
        self.restarts_s: list[float] = []

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            pid = self.stack.engine_pid()
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                continue
            t0 = time.perf_counter()
            self.kills.append(t0)
            say(f"   SIGABRT to the engine (pid {pid})")
            while not self.stop.is_set() and time.perf_counter() - t0 < 300:
                if self.stack.engine_pid() not in (None, pid) and self.stack.healthy():
                    self.restarts_s.append(time.perf_counter() - t0)
                    say(f"   engine back in {self.restarts_s[-1]:.2f} s")
                    break
                time.sleep(0.05)


def one_answer(client: openai.OpenAI, messages: list[dict], max_tokens: int, stream: bool
               ) -> tuple[str, float | None, Any]:
    """(text, time to first content, usage); raises with 'before_answer'/'mid_stream' in the message."""
    t0 = time.perf_counter()
    kw: dict[str, Any] = dict(model="default", messages=messages, max_tokens=max_tokens, temperature=0)
    if not stream:
        try:
            r = client.chat.completions.create(**kw)
        except openai.APIError as exc:
            raise RuntimeError(f"before_answer: {type(exc).__name__}: {exc}"[:300]) from None
        return r.choices[0].message.content or "", time.perf_counter() - t0, r.usage
    parts, ttft, usage, finish = [], None, None, None
    try:
        for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(choice.delta.content)
                finish = choice.finish_reason or finish
    except (openai.APIError, requests.RequestException, Exception) as exc:  # noqa: BLE001 - a cut stream too
        where = "mid_stream" if parts else "before_answer"
        raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}"[:300]) from None
    if finish is None:
        raise RuntimeError("mid_stream: the stream ended with no finish_reason" if parts else
                           "before_answer: the stream ended with no answer")
    return "".join(parts), ttft, usage


def run_agent(i: int, client: openai.OpenAI, system: str, turns: list[str], args: argparse.Namespace,
              start: threading.Barrier, t_origin: float, killer: Killer | None, out: list[Turn]) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    start.wait()
    last_end = time.perf_counter()
    for n, user in enumerate(turns, 1):
        messages.append({"role": "user", "content": user})
        t0 = time.perf_counter()
        turn = Turn(i, n, t0 - t_origin, 0.0, 0, False)
        for attempt in range(1, args.attempts + 1):
            turn.attempts = attempt
            try:
                text, ttft, usage = one_answer(client, messages, args.max_tokens, args.stream)
            except RuntimeError as exc:
                turn.failures.append(str(exc))
                continue
            details = getattr(usage, "prompt_tokens_details", None) if usage else None
            turn.ok, turn.ttft_s = True, ttft
            turn.prompt_tokens = usage.prompt_tokens if usage else 0
            turn.cached_tokens = (details.cached_tokens or 0) if details else 0
            turn.by_ollama = text.startswith(STANDIN_MARK)
            break
        now = time.perf_counter()
        turn.end_s = now - t_origin
        turn.after_restart = killer is not None and any(last_end <= k < now for k in killer.kills)
        last_end = now
        out.append(turn)
        say(f"   agent {i} turn {n}: {'ok' if turn.ok else 'LOST'} after {turn.attempts} attempt(s), "
            f"{turn.cached_tokens} of {turn.prompt_tokens} cached{' (Ollama)' if turn.by_ollama else ''}"
            f"{' after a restart' if turn.after_restart else ''}")
        if not turn.ok:
            return
        messages.append({"role": "assistant", "content": text})


def run_arm(faults: bool, args: argparse.Namespace, systems: list[str], user_turns: list[list[str]]) -> dict:
    settings = Settings(max_concurrency=args.concurrency or args.agents, stuck_grace_s=args.stuck_grace_s,
                        request_timeout_s=args.request_timeout, model=args.model, healthy_reset_s=30.0,
                        prompt_cache_disk_gib=args.disk_gib)
    turns: list[Turn] = []
    with crash_stack(settings, home_root=args.home_root) as stack:
        stack_config = stack.paths  # the quarantine list is read below
        client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=stack.key, max_retries=0,
                               timeout=args.request_timeout)
        stop = threading.Event()
        killer = Killer(stack, args.fault_every_s, stop) if faults else None
        start = threading.Barrier(args.agents + 1)
        t_origin = time.perf_counter()
        threads = [threading.Thread(target=run_agent, args=(i, client, systems[i], user_turns[i], args, start,
                                                             t_origin, killer, turns)) for i in range(args.agents)]
        for t in threads:
            t.start()
        start.wait()
        if killer is not None:
            killer.start()
        for t in threads:
            t.join()
        stop.set()
        if killer is not None:
            killer.join(60)
        quarantine = json.loads(stack_config.quarantine.read_text()) if stack_config.quarantine.exists() else {}
        if args.keep_logs:  # the stack's logs, for a diagnosis (the home itself is removed)
            target = args.keep_logs / ("faults" if faults else "nofaults")
            shutil.copytree(stack.paths.logs, target, dirs_exist_ok=True)
    ok = [t for t in turns if t.ok]
    wall = max((t.end_s for t in turns), default=0.0) - min((t.t0 for t in turns), default=0.0)
    after = [t for t in ok if t.after_restart and not t.by_ollama]  # what the engine reused from disk
    failures = [f for t in turns for f in t.failures]
    return {
        "faults": faults, "turns": [asdict(t) for t in sorted(turns, key=lambda t: (t.agent, t.turn))],
        "turns_completed": len(ok), "turns_lost": args.agents * args.turns - len(ok),  # an agent stops at a lost turn
        "wall_s": wall, "turns_per_minute": 60 * len(ok) / wall if wall else None,
        "failed_before_answer": sum(1 for f in failures if f.startswith("before_answer")),
        "failed_mid_stream": sum(1 for f in failures if f.startswith("mid_stream")),
        "answered_by_ollama": sum(1 for t in ok if t.by_ollama),
        "kills": len(killer.kills) if killer else 0, "restart_s": killer.restarts_s if killer else [],
        "cached_share_after_restart": [round(t.cached_tokens / t.prompt_tokens, 3) if t.prompt_tokens else None
                                       for t in after],
        "ttft_s_p50_turns_2_on": median([t.ttft_s for t in ok if t.turn >= 2 and t.ttft_s is not None]),
        "quarantined": sorted(quarantine.get("fingerprints") or []),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_agent_args(p)
    p.add_argument("--fault-every-s", type=float, default=120.0)
    p.add_argument("--attempts", type=int, default=3, help="tries a turn gets, as an agent's client retries")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests")
    p.add_argument("--arms", default="nofaults,faults")
    p.add_argument("--stuck-grace-s", type=float, default=600.0, help="[engine] stuck_grace_s (a long prefill)")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--keep-logs", type=Path, default=None, help="copy each arm's stack logs into this folder")
    p.add_argument("--disk-gib", type=float, default=None,
                   help="[engine.prompt_cache] disk_gib (default: the config's, which a small disk may cap)")
    p.add_argument("--home-root", type=Path, default=None)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    args.model = args.model or demo_model("a")[1]
    count, source = token_counter(args.model)
    say(f"writing {args.agents} system prompts of {args.system_tokens} tokens and their turns ({source})")
    systems, user_turns = agent_prompts(args.agents, args.system_tokens, args.turn_tokens, args.turns, count)
    arms = {}
    for name in args.arms.split(","):
        say(f"== {name}")
        arms[name] = run_arm(name == "faults", args, systems, user_turns)
    base, hit = arms.get("nofaults"), arms.get("faults")
    ratio = (hit["turns_per_minute"] / base["turns_per_minute"]
             if base and hit and base["turns_per_minute"] and hit["turns_per_minute"] else None)
    doc = {"machine": machine_info(), "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "arms": arms, "faults_over_nofaults_turns_per_minute": ratio}
    write_json(args.out, doc)
    print(f"### Fault replay — {doc['machine']['date']}\n")
    print(f"{doc['machine'].get('gpu') or str(doc['machine']['cpu_count']) + ' CPU cores'}; model {args.model.name}; "
          f"{args.agents} agents, {args.system_tokens}-token system prompts, +{args.turn_tokens} a turn, {args.turns} "
          f"turns, {args.max_tokens}-token answers, {'streamed' if args.stream else 'not streamed'}; a SIGABRT every "
          f"{args.fault_every_s:g} s in the faults arm\n")
    print("| arm | turns done / lost | turns/min | SIGABRTs | restart s (median, max) | failed attempts: before "
          "answer / mid-stream | by Ollama | cached share, first turn after a restart | quarantined |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for name, a in arms.items():
        rs = a["restart_s"]
        shares = ", ".join(f"{s:.2f}" for s in a["cached_share_after_restart"] if s is not None) or "—"
        print(f"| {name} | {a['turns_completed']} / {a['turns_lost']} | {a['turns_per_minute'] or 0:.1f} | {a['kills']} | "
              f"{(f'{median(rs):.1f}, {max(rs):.1f}') if rs else '—'} | {a['failed_before_answer']} / "
              f"{a['failed_mid_stream']} | {a['answered_by_ollama']} | {shares} | {len(a['quarantined'])} |")
    if ratio is not None:
        print(f"\nturns a minute with faults / without: {ratio:.2f}")
    say(f"every turn: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
