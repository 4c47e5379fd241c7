"""What a new shape costs a step on MLX's CUDA backend (a diagnosis, by
hand, on the lent GPU). MLX runs attention there through cuDNN, which
builds a graph for each new shape: a prefill chunk's (its queries' and
keys' lengths and the keys' strides), and a decode step's over a KV buffer
whose length is a whole number of 256-position steps (the buffer's length);
a decode step over any other buffer goes to MLX's own vector kernel, which
builds nothing. Here R rows of long context decode in mlxd's RowBatch, in
process, their KV buffers of lengths (a) whole steps, each its own, (b) one
position more than that, and (c) whole steps, all the same; printed: each
arm's first step (the builds) and its steady steps. Then a prefill chunk at
a new keys' length, and again at the same one, and at a new one with its
keys copied contiguous (strides from the length alone).

    python bench/cuda_shapes_probe.py MODEL_DIR [--context 16000] [--rows 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--context", type=int, default=16000)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import KVCache

    from mlxd.engine.model.row_attention import route_attention
    from mlxd.engine.model.row_batch import RowBatch

    model, _ = load(str(args.model))
    route_attention()
    mx.random.seed(0)

    def synced(fn) -> float:
        mx.synchronize(generation_stream)
        began = time.perf_counter()
        fn()
        mx.synchronize(generation_stream)
        return 1000 * (time.perf_counter() - began)

    def prefilled(length: int) -> list:
        kv = [KVCache() for _ in model.layers]
        tokens = mx.random.randint(0, 1000, (args.context,)).tolist()
        with mx.stream(generation_stream):
            for start in range(0, args.context, 2048):
                model(mx.array([tokens[start:start + 2048]]), cache=kv)
                mx.eval([c.state for c in kv])
        return [rebuffered(c, length) for c in kv]

    def rebuffered(c: KVCache, length: int) -> KVCache:
        """The layer's KV in a buffer of exactly `length` positions."""
        n = c.offset
        out = KVCache()
        for name in ("keys", "values"):
            a = getattr(c, name)
            buf = mx.zeros((*a.shape[:2], length, a.shape[3]), a.dtype)
            buf[..., :n, :] = a[..., :n, :]
            setattr(out, name, buf)
        out.offset = n
        mx.eval(out.keys, out.values)
        return out

    base = -(-(args.context + 64) // 256) * 256
    arms = {
        "whole steps, each row its own length (cuDNN, a graph each)": [base + 256 * i for i in range(args.rows)],
        "one position more (MLX's vector kernel)": [base + 256 * i + 1 for i in range(args.rows)],
        "whole steps, one length for all (cuDNN, one graph)": [base + 256 * 40] * args.rows,
        "whole steps, new lengths again (cuDNN, a graph each)": [base + 256 * (i + 80) for i in range(args.rows)],
    }
    print(f"\n{args.rows} rows of {args.context} tokens, a decode step each, to the device's end\n")
    print("| KV buffers | lengths | first step | second step | steady step (median) |")
    print("|---|---|---:|---:|---:|")
    for name, lengths in arms.items():
        batch = RowBatch(model, frozenset())
        for length in lengths:
            batch.insert(7, prefilled(length), 1_000_000, [], None, [])
        first = synced(batch.next)
        second = synced(batch.next)
        steady = statistics.median(synced(batch.next) for _ in range(args.steps))
        print(f"| {name} | {', '.join(map(str, lengths))} | {first:.1f} ms | {second:.1f} ms | {steady:.1f} ms |",
              flush=True)
        batch.close()

    kv = prefilled(base + 8192)
    chunk = mx.random.randint(0, 1000, (2048,))

    class ContiguousKV(KVCache):
        """Keys and values copied out of the buffer for attention: strides from their length alone."""

        def update_and_fetch(self, keys, values):
            k, v = super().update_and_fetch(keys, values)
            return mx.contiguous(k), mx.contiguous(v)

    def chunk_at(offset: int, contiguous: bool = False) -> float:
        for c in kv:
            c.offset = offset
            c.__class__ = ContiguousKV if contiguous else KVCache

        def run() -> None:
            with mx.stream(generation_stream):
                mx.eval(model(chunk[None], cache=kv)[:, -1])
        return synced(run)

    print("\n| a 2,048-token prefill chunk | ms |\n|---|---:|")
    a, b, c = (args.context * k // 8 for k in (5, 6, 7))
    for label, offset, contiguous in (("at a new keys' length", a, False),
                                      ("at the same length again", a, False),
                                      ("at another new length", b, False),
                                      ("new length, keys contiguous", c, True),
                                      ("same length, keys contiguous, other buffer", c, True)):
        if label.endswith("other buffer"):
            kv = [rebuffered(c, base + 8192 + 256) for c in kv]
        print(f"| {label} (offset {offset}) | {chunk_at(offset, contiguous):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
