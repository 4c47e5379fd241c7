"""Prompt-cache benchmark: an agent's 10-turn conversation, each turn's time to
first token and the share of its prompt served from cache, side by side in
one run for:

  cache      mlxd's engine with its prompt cache (the default): every turn's KV
             written to disk behind it (its new blocks)
  nodisk     the same with `[engine.prompt_cache] disk = false`: what the disk
             tier's write-behind costs a turn's TTFT is cache / nodisk
  nocache    mlxd's engine with `[engine.prompt_cache] enabled = false`: every turn cold
  mlx_lm     `python -m mlx_lm server` with its own LRU prompt cache
  crash      mlxd with the cache, the engine killed by SIGABRT the moment turn 5's
             answer has arrived (no idle moment) and started again on the same state
             directory (what the supervisor does): turn 6 comes from the disk tier

and three conversations interleaved turn by turn (an orchestrator and two
sub-agents), with and without the cache.

The conversation is what agents send: a system prompt with tool schemas of
--system-tokens tokens (about; several thousand on a GPU, fewer on a slow
CPU), then per turn a user message, the model's greedy reply (streamed,
--max-tokens) sent back as the assistant message. Each arm runs --rounds
times, arms alternating; figures are per-turn medians.

  .venv/bin/python bench/prompt_cache.py                       # demo model a, CPU-sized
  .venv/bin/python bench/prompt_cache.py --model PATH --system-tokens 8000 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py)
from benchkit import (RESULTS, BenchError, Server, child_env, demo_model, free_port, machine_info,  # noqa: E402
                      say, spawn, start_engine, stop_all_children, stop_child, write_json)
from mlxd.reports import EngineHealth, PromptCacheReport  # noqa: E402

ARMS = ("cache", "nodisk", "nocache", "mlx_lm", "crash")
CRASH_AFTER_TURN = 5
TOOL_WORDS = ("path", "query", "limit", "recursive", "encoding", "timeout", "branch", "message", "pattern", "lines")


def tool_schemas(n: int) -> list[dict]:
    """n plausible function tools, as an agent framework declares them."""
    tools = []
    for i in range(n):
        props = {w: {"type": "string", "description": f"The {w} for operation {i}; see the manual, section {i}.{j}."}
                 for j, w in enumerate(TOOL_WORDS)}
        tools.append({"type": "function", "function": {
            "name": f"tool_{i}", "description": f"Operation {i} of the workspace: reads, writes or searches files.",
            "parameters": {"type": "object", "properties": props, "required": list(TOOL_WORDS[:2])}}})
    return tools


def system_prompt(approx_tokens: int, salt: str) -> str:
    """A system prompt carrying tool schemas in its text (~4 characters a token
    on real tokenizers; the demo tokenizer uses about 2)."""
    chars = approx_tokens * 3
    text = f"You are agent {salt}. Use the tools below; answer tersely.\n# Tools\n"
    i = 0
    while len(text) < chars:
        text += json.dumps(tool_schemas(i + 1)[-1]) + "\n"
        i += 1
    return text[:chars]


class Chat:
    """Streamed chat turns against an OpenAI-compatible server."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens

    def turn(self, messages: list[dict]) -> dict[str, Any]:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first = last = None
        parts, usage, n_chunks = [], None, 0
        with requests.post(self.url + "/v1/chat/completions", json=body, stream=True, timeout=1800) as r:
            if r.status_code != 200:
                raise BenchError(f"{r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or []:
                    text = (c.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        n_chunks += 1
                        parts.append(text)
        end = time.perf_counter()
        first = first or end
        completion = (usage or {}).get("completion_tokens") or n_chunks
        decode_s = (last or end) - first
        return {"ttft_s": first - t0, "total_s": end - t0, "text": "".join(parts),
                "prompt_tokens": (usage or {}).get("prompt_tokens"),
                "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                "completion_tokens": completion,
                "decode_tok_s": (completion - 1) / decode_s if completion > 1 and decode_s > 0 else None}


def conversation(chat: Chat, system: str, turns: int, on_turn_done=None) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    rows = []
    for t in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Step {t}: run the next tool and report what it found."})
        row = chat.turn(messages)
        row["turn"] = t
        rows.append(row)
        say(f"   turn {t:2d}: TTFT {row['ttft_s'] * 1000:7.0f} ms  cached {row['cached_tokens']:6d} of "
            f"{row['prompt_tokens']} prompt tokens")
        messages.append({"role": "assistant", "content": row["text"] or "(no output)"})
        if on_turn_done is not None:
            on_turn_done(t)
    return rows


def engine_config(model: Path, cache: bool, disk: bool = True) -> dict[str, Any]:
    return {"engine": {"max_tokens_cap": 100000, "max_prompt_tokens": 131072, "stuck_grace_s": 600,
                       "context_tokens": 32768, "prompt_cache": {"enabled": cache, "disk": disk}},
            "models": {"bench": {"path": model.resolve()}}, "aliases": {"default": "bench"}}


def start_mlx_lm(model: Path, workdir: Path) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model.resolve()), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "WARNING"]
    return spawn("mlx_lm.server", argv, child_env(), workdir / "mlx_lm_server.log", port, "/v1/models")


def cache_stats(server: Server) -> PromptCacheReport:
    """The engine's prompt-cache figures, from its /health."""
    health = EngineHealth.from_json(requests.get(server.url + "/health", timeout=5).json())
    if health is None or health.prompt_cache is None:
        raise BenchError("the engine's /health reports no prompt cache")
    return health.prompt_cache


def run_arm(arm: str, model: Path, workdir: Path, system: str, turns: int, max_tokens: int,
            startup_timeout: float) -> tuple[list[dict], dict]:
    extra: dict[str, Any] = {}
    home = workdir / f"home-{arm}-{time.monotonic_ns()}"
    if arm == "mlx_lm":
        server = start_mlx_lm(model, workdir)
        server.wait_ready(startup_timeout)
        chat = Chat(server.url, str(model.resolve()), max_tokens)
    else:
        server = start_engine(home, engine_config(model, arm != "nocache", arm != "nodisk"), workdir / f"engine-{arm}.log")
        server.wait_ready(startup_timeout)
        chat = Chat(server.url, "default", max_tokens)
    holder = {"server": server}
    # One short request first: a GPU compiles its kernels on first use (tens of seconds on CUDA),
    # which is not what a turn costs. Nothing in it is shared with the conversation.
    Chat(chat.url, chat.model, 2).turn([{"role": "user", "content": "warm up " * 300}])

    def crash_between(turn: int) -> None:
        if arm != "crash" or turn != CRASH_AFTER_TURN:
            return
        srv = holder["server"]
        os.kill(srv.proc.pid, signal.SIGABRT)  # what Metal's check_error does: at once, no idle moment
        srv.proc.wait(30)
        stop_child(srv.proc)
        t0 = time.monotonic()
        restarted = restart_engine(home, workdir)  # same state directory, as supervisord restarts it
        restarted.wait_ready(startup_timeout)
        extra["restart_s"] = time.monotonic() - t0
        holder["server"] = restarted
        chat.url = restarted.url

    try:
        rows = conversation(chat, system, turns, crash_between)
        if arm != "mlx_lm":
            extra["cache_stats"] = cache_stats(holder["server"]).to_json()
    finally:
        stop_child(holder["server"].proc)
    return rows, extra


def restart_engine(home: Path, workdir: Path) -> Server:
    """`mlxd engine` again on an existing state directory (its config in it)."""
    return start_engine(home, None, workdir / "engine-restarted.log", "mlxd engine (restarted)")


def run_interleaved(model: Path, workdir: Path, system_tokens: int, turns: int, max_tokens: int, cache: bool,
                    startup_timeout: float) -> list[dict]:
    """Three conversations (different system prompts), one turn each in turn."""
    server = start_engine(workdir / f"home-multi-{cache}-{time.monotonic_ns()}", engine_config(model, cache),
                          workdir / f"engine-multi-{cache}.log")
    rows = []
    try:
        server.wait_ready(startup_timeout)
        chat = Chat(server.url, "default", max_tokens)
        Chat(server.url, "default", 2).turn([{"role": "user", "content": "warm up " * 300}])
        convs = {name: [{"role": "system", "content": system_prompt(system_tokens, name)}]
                 for name in ("orchestrator", "subagent-1", "subagent-2")}
        for t in range(1, turns + 1):
            for name, messages in convs.items():
                messages.append({"role": "user", "content": f"Step {t} for {name}."})
                row = chat.turn(messages) | {"turn": t, "conversation": name}
                messages.append({"role": "assistant", "content": row["text"] or "(no output)"})
                rows.append(row)
                say(f"   {'cache' if cache else 'nocache'} {name:12s} turn {t}: TTFT {row['ttft_s'] * 1000:7.0f} ms  "
                    f"cached {row['cached_tokens']} of {row['prompt_tokens']}")
    finally:
        stop_child(server.proc)
    return rows


def per_turn(rows: list[dict], key: str) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            by.setdefault(r["turn"], []).append(r[key])
    return {t: statistics.median(v) for t, v in sorted(by.items())}


def summarize(results: dict[str, list[dict]], interleaved: dict[str, list[dict]]) -> dict[str, Any]:
    ttft = {arm: per_turn(rows, "ttft_s") for arm, rows in results.items()}
    frac = {arm: {t: statistics.median(r["cached_tokens"] / r["prompt_tokens"] for r in rows
                                       if r["turn"] == t and r["prompt_tokens"])
                  for t in sorted({r["turn"] for r in rows})} for arm, rows in results.items()}
    decode = {arm: statistics.median([r["decode_tok_s"] for r in rows if r["decode_tok_s"] and r["turn"] > 1] or [0])
              for arm, rows in results.items()}
    cold = ttft.get("nocache", {})
    turns = sorted(cold)
    later = [t for t in turns if t >= 2]
    out: dict[str, Any] = {"ttft_s": ttft, "cached_fraction": frac, "decode_tok_s": decode}
    if "cache" in ttft and cold:
        out["cache_over_cold"] = {t: ttft["cache"][t] / cold[t] for t in turns}
        out["min_cached_fraction_from_turn_2"] = min(frac["cache"][t] for t in later)
        out["median_cache_over_cold_from_turn_2"] = statistics.median(out["cache_over_cold"][t] for t in later)
        out["decode_cache_over_nocache"] = decode["cache"] / decode["nocache"] if decode.get("nocache") else None
    if "cache" in ttft and "nodisk" in ttft:
        out["write_behind_ttft_over_nodisk_from_turn_2"] = statistics.median(
            ttft["cache"][t] / ttft["nodisk"][t] for t in ttft["cache"] if t >= 2 and t in ttft["nodisk"])
    if "crash" in ttft and cold:
        t = CRASH_AFTER_TURN + 1
        out["after_crash_over_cold"] = ttft["crash"][t] / cold[t]
        out["after_crash_cached_fraction"] = frac["crash"][t]
    if "mlx_lm" in ttft and "cache" in ttft:
        out["cache_over_mlx_lm_from_turn_2"] = statistics.median(ttft["cache"][t] / ttft["mlx_lm"][t] for t in later)
        out["mlx_lm_cached_fraction_from_turn_2"] = statistics.median(frac["mlx_lm"][t] for t in later)
    if interleaved:
        ic, inc = interleaved.get("cache", []), interleaved.get("nocache", [])
        later_rows = [r for r in ic if r["turn"] >= 2]
        out["interleaved_min_cached_fraction_from_turn_2"] = min(
            (r["cached_tokens"] / r["prompt_tokens"] for r in later_rows), default=None)
        if inc:
            cold_i = {(r["turn"], r["conversation"]): r["ttft_s"] for r in inc}
            out["interleaved_median_cache_over_cold_from_turn_2"] = statistics.median(
                r["ttft_s"] / cold_i[(r["turn"], r["conversation"])] for r in later_rows)
    return out


def markdown(s: dict[str, Any], arms: list[str]) -> str:
    lines = ["| turn | " + " | ".join(f"{a} TTFT ms" for a in arms) + " | cached (cache) | cache / cold |",
             "|---:|" + "---:|" * (len(arms) + 2)]
    for t in sorted(s["ttft_s"][arms[0]]):
        cells = [f"{s['ttft_s'][a].get(t, float('nan')) * 1000:.0f}" for a in arms]
        frac = s["cached_fraction"].get("cache", {}).get(t)
        ratio = (s.get("cache_over_cold") or {}).get(t)
        lines.append(f"| {t} | " + " | ".join(cells) + f" | {'' if frac is None else f'{frac:.1%}'} | "
                     f"{'' if ratio is None else f'{ratio:.3f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an mlx-lm model folder (default: demo model a)")
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--interleaved-turns", type=int, default=3, help="0 to skip the three-conversation run")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=RESULTS / "prompt_cache.json")
    args = ap.parse_args(argv)
    model = args.model or demo_model("a")[1]
    arms = [a for a in args.arms.split(",") if a]
    results: dict[str, list[dict]] = {a: [] for a in arms}
    interleaved: dict[str, list[dict]] = {}
    extras: dict[str, list[dict]] = {a: [] for a in arms}
    system = system_prompt(args.system_tokens, "main")
    with tempfile.TemporaryDirectory(prefix="mlxd-pcache-") as tmp:
        try:
            for rnd in range(args.rounds):
                for arm in arms:
                    say(f"round {rnd + 1}/{args.rounds}: {arm}")
                    rows, extra = run_arm(arm, model, Path(tmp), system, args.turns, args.max_tokens,
                                          args.startup_timeout)
                    results[arm] += [r | {"round": rnd} for r in rows]
                    extras[arm].append(extra)
            if args.interleaved_turns:
                for cache in (True, False):
                    interleaved["cache" if cache else "nocache"] = run_interleaved(
                        model, Path(tmp), args.system_tokens, args.interleaved_turns, args.max_tokens, cache,
                        args.startup_timeout)
        finally:
            stop_all_children()
    summary = summarize(results, interleaved)
    print(markdown(summary, arms))
    for key in ("min_cached_fraction_from_turn_2", "median_cache_over_cold_from_turn_2",
                "write_behind_ttft_over_nodisk_from_turn_2", "after_crash_over_cold",
                "after_crash_cached_fraction", "cache_over_mlx_lm_from_turn_2", "mlx_lm_cached_fraction_from_turn_2",
                "decode_cache_over_nocache", "interleaved_min_cached_fraction_from_turn_2",
                "interleaved_median_cache_over_cold_from_turn_2"):
        if summary.get(key) is not None:
            print(f"{key}: {summary[key]:.3f}")
    write_json(args.out, {"machine": machine_info(), "model": str(model), "settings": vars(args) | {"model": str(model)},
                          "summary": summary, "rows": results, "interleaved": interleaved, "extras": extras})
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
