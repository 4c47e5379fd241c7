#!/usr/bin/env python3
"""Several agents at once, turn after turn: the load mlxd exists for (issue 35).

--agents conversations run together against one `mlxd engine` (benchkit's
start_engine, `[engine] max_concurrency = --concurrency`, `[engine.prompt_cache]
memory_gib = --prompt-cache-gib` when given): each has its own system prompt of
--system-tokens tokens (a coding agent's instructions and tools; distinct per
agent), then --turns turns; a turn adds a user message of --turn-tokens tokens
(a tool's output, say) to the conversation, streams an answer of --max-tokens
greedy tokens, appends it, and the next turn is sent at once. All agents start
together. Every prompt is distinct from its first word, so only an agent's own
earlier turns can be reused.

Reported: turns completed a minute (all agents), TTFT by turn (p50 over the
agents) and the p50 of turns 2 and later (what the prompt cache is for), the
cached share of those turns' prompts, errors, and the engine process's memory
from outside (nvidia-smi per process on a GPU, else the resident set), polled,
against /health's budget and MLX peak.

  .venv/bin/python bench/agents_load.py --system-tokens 1500 --turn-tokens 200 --turns 3 --max-tokens 16   # CPU-sized
  bash bench/gpu_run.sh agents      # the 8B demo model: 4 agents, 12k-token system prompts, +1.7k a turn

--floors (issue 51): then, in the same run and on the same conversations, mlx-lm alone in process
(bench/mlx_lm_floors.py, each floor a process of its own, its memory from outside): equal rows in one plain
batch, unequal rows through BatchKVCache, one row at a time; mlxd's turns a minute against each.

Progress to stderr, a Markdown summary to stdout, every turn to --out (JSON).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import (DEFAULT_CACHE, RESULTS, BenchError, HttpWay, demo_model, interrupt_on_sigterm,  # noqa: E402
                      machine_info, median, one_model_config, percentile, say, start_engine, stop_all_children,
                      stop_child, write_json)
from concurrency import (MemoryWatch, add_agent_args, agent_prompts, engine_extra, fmt_mib,  # noqa: E402
                         gpu_used_bytes, headline_memory, token_counter)
from mlx_lm_floors import FLOORS, run_floors  # noqa: E402

OUT = RESULTS / "agents_load.json"


@dataclass
class Turn:
    agent: int
    turn: int
    t0: float
    ttft_s: float | None
    end_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None


def run_agent(i: int, way: HttpWay, system: str, turns: list[str], max_tokens: int, start: threading.Barrier,
              t_origin: float, out: list[Turn], timeout: float) -> None:
    import json

    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    start.wait()
    for n, user in enumerate(turns, 1):
        messages.append({"role": "user", "content": user})
        payload = json.dumps({"model": "default", "messages": messages, "max_tokens": max_tokens,
                              "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}).encode()
        t0 = time.perf_counter()
        try:
            tr = way.stream("/v1/chat/completions", payload, {"Content-Type": "application/json"}, timeout)
        except (BenchError, requests.RequestException) as exc:
            out.append(Turn(i, n, t0 - t_origin, None, time.perf_counter() - t_origin, 0, 0, 0,
                            f"{type(exc).__name__}: {exc}"[:300]))
            return  # the conversation cannot go on without its answer
        out.append(Turn(i, n, t0 - t_origin, tr.chunk_times[0] - t0 if tr.chunk_times else None,
                        tr.t_end - t_origin, tr.prompt_tokens, tr.cached_prompt_tokens or 0, tr.completion_tokens))
        t = out[-1]
        say(f"   agent {i} turn {n}: {t.prompt_tokens} prompt tokens ({t.cached_tokens} cached), TTFT "
            f"{t.ttft_s if t.ttft_s is None else round(t.ttft_s, 2)} s, ended at {t.end_s:.1f} s")
        messages.append({"role": "assistant", "content": tr.text})


def summarize(turns: list[Turn], agents: int) -> dict[str, Any]:
    ok = [t for t in turns if t.error is None]
    wall = max((t.end_s for t in turns), default=0.0) - min((t.t0 for t in turns), default=0.0)
    by_turn: dict[int, list[float]] = {}
    for t in ok:
        if t.ttft_s is not None:
            by_turn.setdefault(t.turn, []).append(t.ttft_s)
    later = [t for t in ok if t.turn >= 2]
    return {"turns_completed": len(ok), "errors": [asdict(t) for t in turns if t.error], "wall_s": wall,
            "turns_per_minute": 60 * len(ok) / wall if wall > 0 else None,
            "ttft_s_p50_by_turn": {n: median(v) for n, v in sorted(by_turn.items())},
            "ttft_s_p50_turns_2_on": median([t.ttft_s for t in later if t.ttft_s is not None]) if later else None,
            "ttft_s_p95_turns_2_on": percentile([t.ttft_s for t in later if t.ttft_s is not None], 0.95)
            if later else None,
            "cached_share_turns_2_on": (sum(t.cached_tokens for t in later) / sum(t.prompt_tokens for t in later))
            if later and sum(t.prompt_tokens for t in later) else None,
            "agents": agents}


def floors_table(engine: dict[str, Any], floors: dict[str, dict[str, Any]]) -> list[str]:
    """The Markdown rows: each floor's figures (bench/mlx_lm_floors.py) and mlxd's turns a minute over its."""
    f2 = (lambda v, d=2: "—" if v is None else f"{v:.{d}f}")
    ours = engine.get("turns_per_minute")
    lines = ["| mlx-lm alone, in process | turns done | turns/min | TTFT p50 turn 1 (s) "
             "| TTFT p50 / p95 turns 2+ (s) | tokens prefilled | peak memory (from outside) | MLX peak "
             "| mlxd ÷ floor (turns/min) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for doc in floors.values():
        peak, src = headline_memory(doc.get("memory"))
        if doc["status"] != "ok":
            lines.append(f"| {doc['title']} | {doc['status']} | — | — | — | — | {fmt_mib(peak)} ({src}) "
                         "| — | — |")
            continue
        s = doc["summary"]
        tpm = s["turns_per_minute"]
        ratio = f"**{ours / tpm:.2f}x**" if ours and tpm else "—"
        lines.append(f"| {doc['title']} | {s['turns_completed']} | {f2(tpm, 1)} | "
                     f"{f2(s['ttft_s_p50_by_turn'].get(1, s['ttft_s_p50_by_turn'].get('1')))} | "
                     f"{f2(s['ttft_s_p50_turns_2_on'])} / {f2(s['ttft_s_p95_turns_2_on'])} | "
                     f"{s['prefilled_tokens']:,} | "
                     f"{fmt_mib(peak)} ({src}) | {fmt_mib(doc.get('mlx_peak_bytes'))} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_agent_args(p)
    p.add_argument("--prompt-cache-gib", type=float, default=None, help="[engine.prompt_cache] memory_gib")
    p.add_argument("--batching", choices=["auto", "always"], default="auto",
                   help="[engine] batching: auto serves one at a time where its load measured the batch slower")
    p.add_argument("--prefill-step-size", type=int, default=None,
                   help="[engine] prefill_step_size: the most prompt tokens a step (the engine's default where unset)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the engine's log into this folder")
    p.add_argument("--engine-log-level", default="info", help="debug: every batch step's time in the engine's log")
    p.add_argument("--shared-system", action="store_true",
                   help="every agent gets the first agent's system prompt (Claude-Code-shaped agents of one user)")
    p.add_argument("--floors", nargs="?", const=",".join(FLOORS), default="",
                   help="then mlx-lm alone on the same conversations: a subset of plain,batch,serial (all when bare)")
    p.add_argument("--floor-timeout", type=float, default=1800.0, help="seconds a floor may take")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    floors = [f.strip() for f in args.floors.split(",") if f.strip()]
    if any(f not in FLOORS for f in floors):
        p.error(f"--floors: a subset of {','.join(FLOORS)}")
    interrupt_on_sigterm()
    model = args.model or demo_model("a", DEFAULT_CACHE)[1]
    count, count_source = token_counter(model)
    say(f"writing {args.agents} system prompts of {args.system_tokens} tokens and their turns ({count_source})")
    systems, user_turns = agent_prompts(args.agents, args.system_tokens, args.turn_tokens, args.turns, count,
                                        args.seed)
    if args.shared_system:  # one system prompt for all: the turns still differ from the first on
        systems = [systems[0]] * args.agents
    config = one_model_config(model)
    config["engine"].update(engine_extra(max(8, args.agents), args.engine_log_level), max_concurrency=args.concurrency or args.agents,
                            max_prompt_tokens=131072, batching=args.batching)
    if args.prefill_step_size is not None:
        config["engine"]["prefill_step_size"] = args.prefill_step_size
    if args.prompt_cache_gib is not None:
        config["engine"]["prompt_cache"] = {"memory_gib": args.prompt_cache_gib}
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="mlxd-agents-"))
    gpu = gpu_used_bytes() is not None
    baseline = gpu_used_bytes() if gpu else None
    doc: dict[str, Any] = {"machine": machine_info(), "settings": {**{k: str(v) if isinstance(v, Path) else v
                                                                       for k, v in vars(args).items()},
                                                                    "model": model.name, "token_count": count_source}}
    server = start_engine(work / "home", config, work / "engine.log", name="mlxd engine")
    turns: list[Turn] = []
    try:
        server.wait_ready(args.startup_timeout)
        say(f"engine ready (pid {server.proc.pid}); {args.agents} agents, {args.turns} turns each")
        ways = [HttpWay("agents", server.url, "default", server) for _ in range(args.agents)]
        start = threading.Barrier(args.agents)
        t_origin = time.perf_counter()
        threads = [threading.Thread(target=run_agent, args=(i, ways[i], systems[i], user_turns[i], args.max_tokens,
                                                             start, t_origin, turns, args.request_timeout))
                   for i in range(args.agents)]
        with MemoryWatch(server.proc.pid, baseline, server.url + "/health") as watch:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        health = requests.get(server.url + "/health", timeout=10).json()
        mem = {**watch.result(), **{k: health["memory"].get(k) for k in ("mlx_peak_bytes", "mlx_cache_bytes",
                                                                          "budget_bytes", "mlx_memory_limit_bytes")}}
        doc["memory"] = mem
        doc["memory_at_gpu_peak"] = watch.at_gpu_peak
        if watch.at_gpu_peak:
            say("at the GPU peak: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" if isinstance(v, int) and v > 2**20
                                                 else f"{k} {v}" for k, v in watch.at_gpu_peak.items()))
        doc["summary"] = summarize(turns, args.agents)
    finally:
        stop_child(server.proc)
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            (args.keep_logs / "engine-agents.log").write_bytes((work / "engine.log").read_bytes())
        stop_all_children()
    if floors:
        say(f"the floors, mlx-lm alone on the same conversations: {', '.join(floors)}")
        doc["floors"] = run_floors(floors, {"model": str(model), "systems": systems, "user_turns": user_turns,
                                            "max_tokens": args.max_tokens, "shared_prefix": args.shared_system},
                                   work / "floors", args.floor_timeout)
    doc["turns"] = [asdict(t) for t in sorted(turns, key=lambda t: (t.agent, t.turn))]
    write_json(args.out, doc)
    s, mem = doc["summary"], doc["memory"]
    peak, src = headline_memory(mem)
    print(f"### Agents at once — {doc['machine']['date']}\n")
    print(f"{doc['machine'].get('gpu') or doc['machine']['cpu_count']}; model {model.name}; {args.agents} agents, "
          f"max_concurrency {args.concurrency or args.agents} (batching {args.batching}), "
          f"{'one shared system prompt' if args.shared_system else 'system prompts'} {args.system_tokens} tokens, "
          f"+{args.turn_tokens} a turn, {args.turns} turns, {args.max_tokens}-token answers, prompt cache "
          f"{'memory_gib ' + str(args.prompt_cache_gib) if args.prompt_cache_gib is not None else 'defaults'}\n")
    print("| turns done | turns/min | TTFT p50 by turn (s) | TTFT p50 / p95 turns 2+ (s) | cached share turns 2+ "
          "| peak memory | MLX peak / budget | errors |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    by_turn = ", ".join(f"{n}: {v:.2f}" for n, v in s["ttft_s_p50_by_turn"].items())
    fmt = (lambda v, d=2: "—" if v is None else f"{v:.{d}f}")
    print(f"| {s['turns_completed']} | {fmt(s['turns_per_minute'], 1)} | {by_turn} | "
          f"{fmt(s['ttft_s_p50_turns_2_on'])} / {fmt(s['ttft_s_p95_turns_2_on'])} | "
          f"{fmt(s['cached_share_turns_2_on'], 3)} | {fmt_mib(peak)} ({src}) | {fmt_mib(mem.get('mlx_peak_bytes'))} / "
          f"{fmt_mib(mem.get('budget_bytes'))} | {len(s['errors'])} |")
    if floors:
        print("\nThe floors, mlx-lm alone in process on the same conversations (bench/mlx_lm_floors.py), and mlxd's "
              f"{fmt(s['turns_per_minute'], 1)} turns a minute against each:\n")
        print("\n".join(floors_table(s, doc["floors"])))
    say(f"every turn: {args.out}")
    failed = [f for f, d in doc.get("floors", {}).items() if d["status"] not in ("ok", "out of memory")]
    return 0 if not s["errors"] and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
