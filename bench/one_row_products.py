#!/usr/bin/env python3
"""A decoded token's products on the CPU: OpenBLAS's sgemm against its sgemv.

A decoded token goes through each layer as a one-row product, x (1 x in)
times the layer's weights. MLX's CPU backend calls `cblas_sgemm` for every
float32 product; engine/cpu/fast_blas.py's shim sends the one-row ones to
`cblas_sgemv` instead. This measures why, straight on the
`scipy-openblas32` wheel the shim forwards to (ctypes, no MLX), per shape of
the default model (SmolLM2-135M: hidden 576, MLP 1536, k/v 192, vocabulary
49,152), each as weight bytes read per second:

  sgemm            x @ W through sgemm (M = 1), W held in x out (engine/cpu/cpu_linear.py's layout)
  sgemv, in x out  the same product through sgemv (what the shim calls)
  sgemv, out x in  sgemv on W as stored (mlx-lm's nn.Linear layout)

Several copies of each weight are cycled (more bytes than the caches hold),
so every call reads from memory as a decode step does. Best of --repeats.

Usage:
  .venv/bin/python bench/one_row_products.py              # ~20 s
  .venv/bin/python bench/one_row_products.py --threads 2

Progress goes to stderr, the Markdown table to stdout, everything to --out
(JSON, default bench/results/one_row_products.json).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import RESULTS, BenchError, say, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "one_row_products.json"
# (name, inputs, outputs): the default model's one-row products.
SHAPES = (("q / o projection", 576, 576), ("k / v projection", 576, 192), ("gate / up projection", 576, 1536),
          ("down projection", 1536, 576), ("output head (tied embedding)", 576, 49152))
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
CYCLE_BYTES = 64 * 2**20  # more than any cache: each call reads its weights from memory
WAYS = ("sgemm", "sgemv, in x out", "sgemv, out x in")


def copies_for(weight_bytes: int, cycle_bytes: int = CYCLE_BYTES) -> int:
    """How many copies of a weight to cycle through (pure): enough to pass
    `cycle_bytes`, at least 2, at most 64."""
    return max(2, min(64, -(-cycle_bytes // max(1, weight_bytes))))


def calls_for(weight_bytes: int, target_bytes: int = 400 * 2**20) -> int:
    """Calls per timing (pure): ~`target_bytes` read, at least 3."""
    return max(3, target_bytes // max(1, weight_bytes))


def openblas() -> Any:
    try:
        import scipy_openblas32
    except ImportError as exc:
        raise BenchError("the scipy-openblas32 wheel is not installed (a Linux dependency of mlxd)") from exc
    libs = sorted(Path(scipy_openblas32.get_lib_dir()).glob("libscipy_openblas*.so*"))
    if not libs:
        raise BenchError(f"no libscipy_openblas in {scipy_openblas32.get_lib_dir()}")
    lib = ctypes.CDLL(str(libs[0]))
    lib.scipy_openblas_get_config.restype = ctypes.c_char_p
    return lib


def measure(lib: Any, inputs: int, outputs: int, repeats: int) -> dict[str, float]:
    """GB/s of weight read per way, best of `repeats`; checks the three agree."""
    import numpy as np

    f = ctypes.POINTER(ctypes.c_float)
    rng = np.random.default_rng(inputs * outputs)
    w = rng.standard_normal((inputs, outputs)).astype(np.float32)
    n = copies_for(w.nbytes)
    in_out = [w.copy() for _ in range(n)]
    out_in = [np.ascontiguousarray(w.T) for _ in range(n)]
    x = rng.standard_normal((1, inputs)).astype(np.float32)
    y = np.zeros((1, outputs), np.float32)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    px, py = x.ctypes.data_as(f), y.ctypes.data_as(f)

    def sgemm(m: Any) -> None:
        lib.scipy_cblas_sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, 1, outputs, inputs, one, px, inputs,
                              m.ctypes.data_as(f), outputs, zero, py, outputs)

    def sgemv_in_out(m: Any) -> None:
        lib.scipy_cblas_sgemv(ROW_MAJOR, TRANS, inputs, outputs, one, m.ctypes.data_as(f), outputs, px, 1, zero,
                              py, 1)

    def sgemv_out_in(m: Any) -> None:
        lib.scipy_cblas_sgemv(ROW_MAJOR, NO_TRANS, outputs, inputs, one, m.ctypes.data_as(f), inputs, px, 1, zero,
                              py, 1)

    want = x @ w
    calls = calls_for(w.nbytes)
    got: dict[str, float] = {}
    for way, fn, mats in zip(WAYS, (sgemm, sgemv_in_out, sgemv_out_in), (in_out, in_out, out_in)):
        fn(mats[0])
        if not np.allclose(y, want, rtol=1e-3, atol=1e-3):
            raise BenchError(f"{way} gave a wrong product for {inputs} x {outputs}")
        got[way] = w.nbytes / best_seconds(lambda: [fn(mats[i % n]) for i in range(calls)], repeats) * calls / 1e9
    return got


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The Markdown table (pure)."""
    lines = ["| product | weights | sgemm GB/s | sgemv, in x out GB/s | sgemv, out x in GB/s | sgemv / sgemm |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = r["gb_s"]
        lines.append(f"| {r['name']} ({r['inputs']} x {r['outputs']}) | {r['inputs'] * r['outputs'] * 4 / 2**20:.1f} "
                     f"MiB | {g['sgemm']:.1f} | {g['sgemv, in x out']:.1f} | {g['sgemv, out x in']:.1f} | "
                     f"{g['sgemv, in x out'] / g['sgemm']:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="OPENBLAS_NUM_THREADS (1, the engine's default on 2 cores)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", default="", help="comma-separated INxOUT to measure instead of the default model's")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # read when OpenBLAS loads, below
    shapes = SHAPES
    if args.shapes:
        try:
            shapes = tuple((s, *map(int, s.lower().split("x"))) for s in args.shapes.split(","))
        except ValueError:
            p.error("--shapes takes INxOUT,INxOUT,...")
    try:
        lib = openblas()
        say(f"==> {lib.scipy_openblas_get_config().decode()}, {args.threads} thread(s)")
        rows = []
        for name, inputs, outputs in shapes:
            gb_s = measure(lib, inputs, outputs, args.repeats)
            say(f"   {name}: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in gb_s.items()))
            rows.append({"name": name, "inputs": inputs, "outputs": outputs, "gb_s": gb_s})
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    print("\n".join(table(rows)))
    write_json(args.out, {"blas": lib.scipy_openblas_get_config().decode(), "threads": args.threads,
                          "repeats": args.repeats, "cpu_count": os.cpu_count(), "rows": rows})
    say(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
