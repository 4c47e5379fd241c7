#!/usr/bin/env python3
"""Idle unload (issue 38): the memory an idle model gives back, measured from
outside the engine, and what the next turn of its conversation then costs.

One `mlxd engine` with `[engine] keep_alive` (--keep-alive), on the default
model (or --model), the tiny demo model it preloads given back first: its process RSS (and, on CUDA, its device
memory from nvidia-smi) before any model, after a turn of an agent's
conversation (a --system-tokens system prompt), while /health is polled until
the idle unload, and after it; then the conversation's next turn, which loads
the model again: its TTFT against the load time (/health's last_load_s) and
the share of its prompt that came from the prompt cache's disk tier.

  .venv/bin/python bench/idle_unload.py                  # the default model, keep_alive 10s
  .venv/bin/python bench/idle_unload.py --model PATH     # an mlx-lm model folder
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import (RESULTS, machine_info, md_table, say, start_engine, stop_all_children,  # noqa: E402
                      stream_chat, write_json)

SYSTEM_LINE = "You are a coding agent working in a repository of a small web service; keep answers short. "


def device_bytes(pid: int) -> int | None:
    """The process's GPU memory from nvidia-smi (None: no NVIDIA card, or the process holds none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        p, _, mib = line.partition(",")
        if p.strip() == str(pid):
            return int(mib.strip()) * 2**20
    return None


def memory(pid: int) -> dict[str, int | None]:
    return {"rss": psutil.Process(pid).memory_info().rss, "device": device_bytes(pid)}


def turn(url: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    answer = stream_chat(url, messages, max_tokens)
    return {"ttft_s": (answer["first"] or answer["end"]) - answer["started"], "text": answer["text"],
            "usage": answer["usage"], "ended": time.monotonic()}


def returned_share(base: int, loaded: int, after: int) -> float | None:
    """The share of what loading took that the unload gave back (pure)."""
    held = loaded - base
    return (loaded - after) / held if held > 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an mlx-lm model folder (default: mlxd's default model)")
    ap.add_argument("--keep-alive", default="10s")
    ap.add_argument("--system-tokens", type=int, default=1500, help="about this many tokens of system prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS / "idle_unload.json")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="mlxd-idle-"))
    from mlxd import default_model

    # The engine preloads a model at start: the tiny demo model, given back at once (a request's keep_alive 0),
    # so the process is measured with no model before the one measured is loaded.
    target = {"path": args.model.resolve()} if args.model else {"gguf": str(default_model.gguf_path())}
    config: dict[str, Any] = {"engine": {"keep_alive": args.keep_alive, "default_model": "tiny", "stuck_grace_s": 600},
                              "models": {"bench": target, "tiny": {"demo": "a"}}, "aliases": {"default": "bench"}}
    try:
        server = start_engine(work / "home", config, work / "engine.log")
        server.wait_ready(600)
        pid = server.proc.pid
        r = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 1, "keep_alive": 0, "messages": [{"role": "user", "content": "hi"}]})
        r.raise_for_status()
        while server.health()["resident_model"] is not None:
            time.sleep(0.1)
        base = memory(pid)
        say(f"engine up, no model: RSS {base['rss'] / 2**20:.0f} MiB")
        messages = [{"role": "system", "content": SYSTEM_LINE * max(1, args.system_tokens // 18)},
                    {"role": "user", "content": "List three things to check before a release."}]
        first = turn(server.url, messages, args.max_tokens)
        loaded_health = server.health()
        loaded = memory(pid)
        say(f"turn 1: TTFT {first['ttft_s']:.2f} s (load {loaded_health['timings'].get('last_load_s', 0):.2f} s), "
            f"RSS {loaded['rss'] / 2**20:.0f} MiB; waiting for the idle unload ({args.keep_alive})")
        samples = []
        while True:
            h = server.health()
            m = memory(pid)
            samples.append({"t": round(time.monotonic() - first["ended"], 2), **m, "resident": h["resident_model"]})
            if h["resident_model"] is None:
                break
            if time.monotonic() - first["ended"] > 3600:
                raise SystemExit("no idle unload within an hour")
            time.sleep(0.2)  # a sampling interval (the curve), not a synchronisation
        unloaded_after = time.monotonic() - first["ended"]
        settle = time.monotonic()
        after = memory(pid)
        while time.monotonic() - settle < 5:  # the goal's window: what is back within keep_alive + 5 s
            after = memory(pid)
            time.sleep(0.2)
        say(f"unloaded {unloaded_after:.1f} s after the turn: RSS {after['rss'] / 2**20:.0f} MiB")
        messages += [{"role": "assistant", "content": first["text"]},
                     {"role": "user", "content": "And after the release?"}]
        second = turn(server.url, messages, args.max_tokens)
        reloaded = server.health()
        load_s = reloaded["timings"].get("last_load_s", 0.0)
        cached = second["usage"].get("prompt_tokens_details", {}).get("cached_tokens") or 0
        prompt = second["usage"].get("prompt_tokens") or 1
    finally:
        stop_all_children()
    result = {
        "keep_alive": args.keep_alive, "unloaded_after_s": unloaded_after,
        "rss": {"base": base["rss"], "loaded": loaded["rss"], "after": after["rss"],
                "returned": returned_share(base["rss"], loaded["rss"], after["rss"])},
        "device": ({"base": base["device"], "loaded": loaded["device"], "after": after["device"],
                    "returned": returned_share(base["device"] or 0, loaded["device"], after["device"] or 0)}
                   if loaded["device"] else None),
        "turn1_ttft_s": first["ttft_s"], "turn2_ttft_s": second["ttft_s"], "reload_s": load_s,
        "turn2_over_load_s": second["ttft_s"] - load_s, "turn2_cached_share": cached / prompt,
        "turn2_prompt_tokens": prompt, "samples": samples}
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    rows = [["process RSS", mib(base["rss"]), mib(loaded["rss"]), mib(after["rss"]),
             f"{result['rss']['returned']:.1%}" if result["rss"]["returned"] is not None else "—"]]
    if result["device"]:
        d = result["device"]
        rows.append(["device memory", mib(d["base"] or 0), mib(d["loaded"]), mib(d["after"] or 0), f"{d['returned']:.1%}"])
    md = md_table(["memory", "no model", "after a turn", f"unloaded ({unloaded_after:.1f} s idle)", "given back"], rows)
    md += (f"\n\nnext turn: TTFT {second['ttft_s']:.2f} s = the reload {load_s:.2f} s + {second['ttft_s'] - load_s:.2f} s; "
           f"{cached} of its {prompt} prompt tokens ({cached / prompt:.1%}) from the prompt cache")
    print(md)
    write_json(args.out, {"benchmark": "idle_unload", "machine": machine_info(), "settings": vars(args), **result,
                          "table": md})
    say(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
