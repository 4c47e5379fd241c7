"""Model swap benchmark: the one-model cache's cost and its memory promise.

One engine with two models (demo a and b by default). Measured in one run:
  cold load  the engine's own load time for each model when nothing is resident
             (its preload, in a fresh engine per model)
  swap       a request for the other model: unload + load (the engine's timings)
             and the request's wall time, over --swaps alternating swaps
  memory     after each swap: MLX active (steady) and MLX peak since the unload,
             against each model's own footprint; RSS over the swaps
Goals (issue 6): peak <= max(A, B) + 5 %, no growth of active memory or RSS.

  .venv/bin/python bench/swap.py [--swaps 20] [--model-a PATH --model-b PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py)
from benchkit import (RESULTS, Server, demo_model, machine_info, say, start_engine, stop_all_children,  # noqa: E402
                      stop_child, write_json)

MIB = 2**20


def start(workdir: Path, models: dict[str, Path], default: str, tag: str) -> Server:
    config = {"engine": {"default_model": default},
              "models": {name: {"path": p.resolve()} for name, p in models.items()}, "aliases": {"default": default}}
    server = start_engine(workdir / f"home-{tag}", config, workdir / f"{tag}.log", f"engine ({tag})")
    server.wait_ready(300)
    return server


def health(server: Server) -> dict:
    return requests.get(server.url + "/health", timeout=10).json()


def ask(server: Server, model: str) -> float:
    t0 = time.perf_counter()
    r = requests.post(server.url + "/v1/completions", timeout=600,
                      json={"model": model, "prompt": "swap", "max_tokens": 2, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--swaps", type=int, default=20)
    ap.add_argument("--model-a", type=Path)
    ap.add_argument("--model-b", type=Path)
    ap.add_argument("--out", type=Path, default=RESULTS / "swap.json")
    args = ap.parse_args(argv)
    if args.model_a and args.model_b:
        models = {"a": args.model_a, "b": args.model_b}
    else:
        models = {v: demo_model(v)[1] for v in ("a", "b")}
    rows, cold = [], {}
    with tempfile.TemporaryDirectory(prefix="mlxd-swap-") as tmp:
        try:
            for name in models:  # cold loads: a fresh engine preloads one model from nothing
                server = start(Path(tmp), models, name, f"cold-{name}")
                h = health(server)
                cold[name] = {"load_s": h["timings"]["last_load_s"],
                              "active_bytes": h["memory"]["mlx_active_bytes"] - h["memory"]["mlx_active_before_first_load"],
                              "peak_bytes": h["memory"]["mlx_peak_bytes"]}
                say(f"cold load {name}: {cold[name]['load_s']:.3f}s, active {cold[name]['active_bytes'] / MIB:.1f} MiB")
                stop_child(server.proc)
            server = start(Path(tmp), models, "a", "swaps")
            order = ["b", "a"] * (args.swaps // 2 + 1)
            for i, name in enumerate(order[: args.swaps]):
                wall = ask(server, name)
                h = health(server)
                mem = h["memory"]
                rows.append({"to": name, "wall_s": wall, "unload_s": h["timings"]["last_unload_s"],
                             "load_s": h["timings"]["last_load_s"], "active_bytes": mem["mlx_active_bytes"],
                             "peak_bytes": mem["mlx_peak_bytes"], "rss_bytes": mem["rss_bytes"]})
                say(f"swap {i + 1}/{args.swaps} -> {name}: wall {wall:.3f}s, unload {rows[-1]['unload_s']:.3f}s, "
                       f"load {rows[-1]['load_s']:.3f}s, active {mem['mlx_active_bytes'] / MIB:.1f} MiB, "
                       f"peak {mem['mlx_peak_bytes'] / MIB:.1f} MiB, RSS {mem['rss_bytes'] / MIB:.0f} MiB")
        finally:
            stop_all_children()
    largest_peak = max(c["peak_bytes"] for c in cold.values())
    print("\n| model | cold load s | swap in: unload + load s (median) | ratio | wall s | active MiB | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in models:
        mine = [r for r in rows if r["to"] == name]
        swap_s = statistics.median(r["unload_s"] + r["load_s"] for r in mine)
        print(f"| {name} | {cold[name]['load_s']:.3f} | {swap_s:.3f} | {swap_s / cold[name]['load_s']:.2f}x | "
              f"{statistics.median(r['wall_s'] for r in mine):.3f} | "
              f"{statistics.median(r['active_bytes'] for r in mine) / MIB:.1f} | "
              f"{max(r['peak_bytes'] for r in mine) / MIB:.1f} |")
    worst_peak = max(r["peak_bytes"] for r in rows)
    half = len(rows) // 2
    rss_growth = statistics.median(r["rss_bytes"] for r in rows[half:]) - statistics.median(r["rss_bytes"] for r in rows[:half])
    print(f"\npeak over all swaps {worst_peak / MIB:.1f} MiB vs largest single model's cold peak "
          f"{largest_peak / MIB:.1f} MiB: {worst_peak / largest_peak:.3f}x (goal <= 1.05x)")
    print(f"RSS: second half vs first half median {rss_growth / MIB:+.1f} MiB (goal: no growth)")
    write_json(args.out, {"machine": machine_info(), "cold": cold, "swaps": rows,
                          "peak_ratio": worst_peak / largest_peak, "rss_growth_bytes": rss_growth})
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
