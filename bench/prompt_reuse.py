"""Prompt reuse benchmark: second-turn TTFT of a multi-turn conversation with
a long shared prefix, against the first turn's, side by side.

An agent's turns share a long prefix (system prompt, tools, history). Without
a prompt cache every turn pays the whole prefill again, so turn 2 is no
faster than turn 1; a prompt cache (a later issue) should make it much
faster. Streamed chat to the engine, greedy, alternating fresh conversations.

  .venv/bin/python bench/prompt_reuse.py [--rounds 7] [--prefix-words 1500] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py)
from benchkit import (RESULTS, Server, demo_model, machine_info, one_model_toml, say, start_engine,  # noqa: E402
                      stop_all_children, write_json)

WORDS = ("the engine serves one request at a time and keeps one model resident while the supervisor watches "
         "for crashes and the gateway falls back to ollama when needed").split()


def ttft(server: Server, messages: list[dict]) -> tuple[float, str]:
    """Seconds to the first content chunk, and the whole reply."""
    t0 = time.perf_counter()
    first, parts = None, []
    with requests.post(server.url + "/v1/chat/completions", stream=True, timeout=600,
                       json={"model": "default", "messages": messages, "max_tokens": 16, "temperature": 0,
                             "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if delta:
                first = first or time.perf_counter()
                parts.append(delta)
    return (first or time.perf_counter()) - t0, "".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefix-words", type=int, default=600)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path, default=RESULTS / "prompt_reuse.json")
    args = ap.parse_args(argv)
    if args.model is None:
        args.model = demo_model("b")[1]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlxd-reuse-") as tmp:
        try:
            server = start_engine(Path(tmp) / "mlxd-home", one_model_toml(args.model), Path(tmp) / "engine.log")
            server.wait_ready(300)
            for i in range(args.rounds + 1):  # round 0 warms up
                system = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(args.prefix_words))
                turn1 = [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]
                t1, reply = ttft(server, turn1)
                turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
                t2, _ = ttft(server, turn2)
                if i:
                    rows.append({"turn1_ttft_s": t1, "turn2_ttft_s": t2})
                    say(f"round {i}/{args.rounds}: turn 1 {t1 * 1000:.0f} ms, turn 2 {t2 * 1000:.0f} ms")
        finally:
            stop_all_children()
    m1 = statistics.median(r["turn1_ttft_s"] for r in rows)
    m2 = statistics.median(r["turn2_ttft_s"] for r in rows)
    print(f"\n| turn | TTFT ms (median) | ratio to turn 1 |\n|---|---:|---:|\n| 1 | {m1 * 1000:.0f} | 1.00 |\n"
          f"| 2 | {m2 * 1000:.0f} | {m2 / m1:.2f} |")
    write_json(args.out, {"machine": machine_info(), "prefix_words": args.prefix_words, "rounds": rows,
                          "turn2_over_turn1": m2 / m1})
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
