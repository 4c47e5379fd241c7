#!/usr/bin/env python3
"""A decode step's attention for rows that share a prompt prefix: cascade against per-row attention.

Issue 51 item 3's shape: four agents share a 12k-token system prompt, each
with a few thousand tokens of its own, on an 8B model (32 query heads, 8 KV
heads, head_dim 128, bfloat16). Per step and layer, the arms compute the
same attention (engine/model/cascade_attention.py):

  rows             MLX's fused kernel per row over the row's own whole KV (mlxd today: the prefix held B times)
  rows, concat     the same over [shared prefix | own suffix] concatenated each step (prefix held once,
                   no cascade: what CASCADE = False costs)
  cascade          all rows' queries against the prefix in one product, each suffix apart, merged by
                   log-sum-exp; `explicit` (softmax computed) and `fused` (MLX's kernel, log-sum-exp beside)

Each timed call is one decode step: every arm over `--layers` layers of
distinct arrays (so a step reads its KV from memory, not a cache the last
call left warm), evaluated once; median of `--repeats`. Each arm's output is
checked against `rows` first (worst |difference|, in the table).

Usage:
  .venv/bin/python bench/cascade_attention.py                  # CPU-sized shapes (~1 min on 2 cores)
  .venv/bin/python bench/cascade_attention.py --shape goal     # the goal shape (a GPU; ~4 GiB a layer set)
  .venv/bin/python bench/cascade_attention.py --shape all --queries 1,4 --layers 32

The Markdown table goes to stdout, everything to --out (JSON, default
bench/results/cascade_attention.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from benchkit import RESULTS, machine_info, md_table, say, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "cascade_attention.json"
ARMS = ("rows", "rows, concat", "cascade explicit", "cascade fused")


@dataclass(frozen=True)
class Shape:
    name: str
    prefix: int
    suffixes: tuple[int, ...]  # one a row
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    def kv_bytes(self, dtype_bytes: int, shared: bool) -> int:
        """K and V bytes a layer's step reads: the prefix once (shared) or once a row."""
        tokens = sum(self.suffixes) + self.prefix * (1 if shared else len(self.suffixes))
        return 2 * tokens * self.kv_heads * self.head_dim * dtype_bytes


SHAPES = {
    "tiny": Shape("tiny", 256, (16, 48), heads=8, kv_heads=2, head_dim=64),
    "small": Shape("small", 1024, (128, 256, 384, 512)),
    "medium": Shape("medium", 4096, (512, 1024, 1536, 2048)),
    "goal": Shape("goal", 12288, (2048, 4096, 6144, 8192)),
}
CPU_SHAPES = ("tiny", "small", "medium")


def arms(mx: Any, shape: Shape, queries_a_row: int, dtype: Any, layers: int) -> dict[str, Callable[[], list]]:
    """Each arm as a function computing one step's attention over every layer."""
    from mlxd.engine.model.cascade_attention import cascade_attention

    B, L, D = len(shape.suffixes), queries_a_row, shape.head_dim
    scale = D ** -0.5
    mask = "causal" if L > 1 else None
    sdpa = mx.fast.scaled_dot_product_attention

    def normal(*dims: int) -> Any:
        return (mx.random.normal(dims) * 0.5).astype(dtype)

    per_layer = []
    for _ in range(layers):
        prefix = [normal(1, shape.kv_heads, shape.prefix, D) for _ in range(2)]
        own = [tuple(normal(1, shape.kv_heads, s, D) for _ in range(2)) for s in shape.suffixes]
        whole = [tuple(mx.concatenate([p, o], axis=2) for p, o in zip(prefix, kv)) for kv in own]  # a row's own copy
        per_layer.append((normal(B, shape.heads, L, D), prefix, own, whole))
        mx.eval(per_layer[-1])

    def rows() -> list:
        return [mx.concatenate([sdpa(q[i:i + 1], k, v, scale=scale, mask=mask) for i, (k, v) in enumerate(whole)])
                for q, _, _, whole in per_layer]

    def rows_concat() -> list:
        return [mx.concatenate([sdpa(q[i:i + 1], mx.concatenate([prefix[0], k], axis=2),
                                     mx.concatenate([prefix[1], v], axis=2), scale=scale, mask=mask)
                                for i, (k, v) in enumerate(own)])
                for q, prefix, own, _ in per_layer]

    def cascade(way: str) -> Callable[[], list]:
        return lambda: [cascade_attention(q, prefix[0], prefix[1], own, scale, way=way)
                        for q, prefix, own, _ in per_layer]

    return {"rows": rows, "rows, concat": rows_concat, "cascade explicit": cascade("explicit"),
            "cascade fused": cascade("fused")}


def timed(mx: Any, fns: dict[str, Callable[[], list]], repeats: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of each call of each arm, evaluated, the arms taking turns (so
    a busy moment of the machine falls on all of them), after `warmup` rounds."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for n in range(warmup + repeats):
        for name, fn in fns.items():
            began = time.perf_counter()
            mx.eval(fn())
            if n >= warmup:
                out[name].append(time.perf_counter() - began)
    return out


def measure(mx: Any, shape: Shape, queries_a_row: int, dtype_name: str, layers: int, repeats: int) -> dict:
    dtype = getattr(mx, dtype_name)
    fns = arms(mx, shape, queries_a_row, dtype, layers)
    reference = [o.astype(mx.float32) for o in fns["rows"]()]
    result = {"shape": asdict(shape), "queries_a_row": queries_a_row, "dtype": dtype_name, "layers": layers,
              "kv_bytes_a_layer": {"own copies": shape.kv_bytes(dtype.size, False),
                                   "shared": shape.kv_bytes(dtype.size, True)},
              "arms": {}}
    worst = {name: max(float(mx.abs(o.astype(mx.float32) - r).max()) for o, r in zip(fn(), reference))
             for name, fn in fns.items()}
    for name, seconds in timed(mx, fns, repeats).items():
        result["arms"][name] = {"step_s": statistics.median(seconds), "runs_s": seconds, "worst_diff": worst[name]}
        say(f"  {shape.name} q{queries_a_row} {name}: {1000 * statistics.median(seconds) / layers:.3f} ms a layer")
    return result


def table(results: list[dict]) -> list[str]:
    """The Markdown table: ms a layer per arm, its gain over `rows`, and the KV it reads per second."""
    header = ["shape", "q a row", "arm", "ms a layer", "vs rows", "KV read GB/s", "worst diff"]
    out = []
    for r in results:
        s = r["shape"]
        base = r["arms"]["rows"]["step_s"]
        label = f"{s['name']}: {len(s['suffixes'])} rows, prefix {s['prefix']}, own {min(s['suffixes'])}-" \
                f"{max(s['suffixes'])}, {s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, {r['dtype']}"
        for name, arm in r["arms"].items():
            kv = r["kv_bytes_a_layer"]["own copies" if name == "rows" else "shared"]
            per_layer = arm["step_s"] / r["layers"]
            out.append([label, str(r["queries_a_row"]), name, f"{1000 * per_layer:.3f}", f"{base / arm['step_s']:.2f}x",
                        f"{kv / per_layer / 1e9:.1f}", f"{arm['worst_diff']:.2g}"])
            label = ""
    return md_table(header, out).splitlines()


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx

    gpu = mx.default_device() == mx.gpu
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default=None,
                   help=f"comma-separated of {','.join(SHAPES)} or 'all' (default: {','.join(CPU_SHAPES)} on a "
                        "CPU, all on a GPU)")
    p.add_argument("--queries", default="1", help="queries a row, comma-separated: 1 decode, more a verify step")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--layers", type=int, default=32 if gpu else 4, help="layers a step (distinct arrays)")
    p.add_argument("--repeats", type=int, default=20 if gpu else 5)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    picked = list(SHAPES) if args.shape == "all" or (args.shape is None and gpu) else \
        (args.shape or ",".join(CPU_SHAPES)).split(",")
    unknown = [s for s in picked if s not in SHAPES]
    if unknown:
        p.error(f"--shape: unknown {','.join(unknown)} (choose from {','.join(SHAPES)}, all)")
    mx.random.seed(0)
    results = []
    for name in picked:
        for q in (int(x) for x in args.queries.split(",")):
            results.append(measure(mx, SHAPES[name], q, args.dtype, args.layers, args.repeats))
            mx.clear_cache()
    lines = table(results)
    print(f"device: {mx.default_device()}, {args.layers} layers a step, median of {args.repeats}")
    print("\n".join(lines))
    write_json(args.out, {"machine": machine_info(), "device": str(mx.default_device()), "args": vars(args),
                          "results": results, "table": lines})
    return 0


if __name__ == "__main__":
    sys.exit(main())
