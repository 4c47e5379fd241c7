#!/usr/bin/env python3
"""The memory-bandwidth bound of decoding: how many tokens/s the device could
reach if every generated token only had to read the weights once.

Decoding one token reads every weight once (embedding: one row) plus the KV
cache so far, and does little arithmetic per byte, so on a GPU its speed is
bounded by memory bandwidth:

    bound tok/s = measured read bandwidth / bytes read per token

The read bandwidth is measured here, with MLX on the default device, two ways,
and the higher one is used (the stricter bound):
  reduce  sum over a large bf16 array (a pure streaming read)
  gemv    a large bf16 matrix times a vector (what decoding does)

    python bench/roofline.py MODEL_DIR [--context 300]      # prints JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

GIB = 2**30


def _timed(fn, repeats: int) -> float:
    """Median seconds of fn() (which must force evaluation)."""
    fn()
    fn()  # warm: kernels compiled, memory resident
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(gib: float = 4.0, repeats: int = 20) -> dict[str, float]:
    """Bytes/s read by a streaming reduction and by a gemv over `gib` GiB of bf16."""
    import mlx.core as mx

    cols = 8192
    rows = int(gib * GIB / 2 / cols)
    x = mx.ones((rows, cols), mx.bfloat16)
    v = mx.ones((cols,), mx.bfloat16)
    mx.eval(x, v)
    nbytes = rows * cols * 2
    reduce_s = _timed(lambda: mx.eval(mx.sum(x)), repeats)
    gemv_s = _timed(lambda: mx.eval(x @ v), repeats)
    del x, v
    return {"reduce_bytes_per_s": nbytes / reduce_s, "gemv_bytes_per_s": nbytes / gemv_s, "bytes": nbytes}


def bytes_per_token(model_dir: Path, context: int) -> dict[str, int]:
    """Weight bytes read per decoded token (embedding: one row; a tied lm_head
    reads the table once) plus the KV cache at `context` tokens."""
    import mlx.core as mx

    config = json.loads((model_dir / "config.json").read_text())
    weights: dict[str, tuple[tuple[int, ...], int]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, arr in mx.load(str(f)).items():  # lazy: shapes without reading the data
            weights[name] = (tuple(arr.shape), arr.nbytes)
    total = sum(b for _, b in weights.values())
    embed = next((v for k, v in weights.items() if k.endswith("embed_tokens.weight")), None)
    tied = not any(k.endswith("lm_head.weight") for k in weights)
    weight_bytes = total
    if embed is not None and not tied:  # the untied embedding table: only one row is read
        shape, nbytes = embed
        weight_bytes -= nbytes - nbytes // shape[0]
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = 2  # fp16/bf16 KV cache
    kv = 2 * config["num_hidden_layers"] * heads * head_dim * itemsize * context
    return {"weight_bytes": weight_bytes, "kv_bytes": kv, "total": weight_bytes + kv, "file_bytes": total}


def bound(model_dir: Path, context: int = 300, gib: float = 4.0) -> dict:
    import mlx.core as mx

    bw = read_bandwidth(gib)
    per_token = bytes_per_token(model_dir, context)
    best = max(bw["reduce_bytes_per_s"], bw["gemv_bytes_per_s"])
    return {"device": str(mx.default_device()), "read_bandwidth": bw, "bandwidth_used_bytes_per_s": best,
            "bytes_per_token": per_token, "context_tokens": context,
            "bound_tok_s": best / per_token["total"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--context", type=int, default=300, help="KV cache length counted per token (default 300)")
    ap.add_argument("--gib", type=float, default=4.0, help="GiB of data for the bandwidth probe (default 4)")
    args = ap.parse_args(argv)
    print(json.dumps(bound(args.model, args.context, args.gib), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
