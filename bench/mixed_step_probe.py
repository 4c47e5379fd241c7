"""What a joining prompt costs the decoding rows (a diagnosis, by hand, on
the lent GPU): R rows of long context decode in mlxd's RowBatch, in
process, while one more prompt of N new tokens over the same context
joins, as the engine runs it (engine/model/batch_decoder.py): its chunk in
the decoding rows' step (a mixed step), then its first step as a row. Each
part is timed to the device's end (`mx.synchronize` before and after), and
the same sequence is timed as the engine's step log sees it (pipelined, no
synchronize). A chunk size seen for the first time is timed apart from a
repeat of it (kernels built per shape).

    python bench/mixed_step_probe.py MODEL_DIR [--context 15600] [--rows 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--context", type=int, default=15600)
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--sizes", default="2048,2048,1904,1904,1910,1922,512,512,500",
                   help="the joining chunks' sizes, in order (a repeat shows a shape's second time)")
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlxd.engine.cache.kv_cache import make_kv
    from mlxd.engine.model.row_attention import route_attention
    from mlxd.engine.model.row_batch import RowBatch
    from mlxd.engine.model.row_segments import forward_segments, route_rope
    from mlxd.memory_estimate import KVLayout

    model, _ = load(str(args.model))
    route_attention()
    route_rope()
    sizes = [int(s) for s in args.sizes.split(",")]
    capacity = args.context + max(sizes) + 4096
    mx.random.seed(0)

    def prefilled() -> list:
        kv = make_kv(model, capacity, KVLayout())
        tokens = mx.random.randint(0, 1000, (args.context,)).tolist()
        for start in range(0, args.context, 2048):
            model(mx.array([tokens[start:start + 2048]]), cache=kv)
            mx.eval([c.state for c in kv])
        return kv

    batch = RowBatch(model, frozenset())
    for r in range(args.rows):
        batch.insert(7, prefilled(), 1_000_000, [], None, [])
        print(f"row {r} prefilled ({args.context} tokens)", flush=True)
    joiner = prefilled()
    plain_cache = make_prompt_cache(model)  # mlx-lm's own KVCache (grown 256 at a time), the floor's
    for start in range(0, args.context, 2048):
        model(mx.array([list(range(start % 1000, start % 1000 + min(2048, args.context - start)))]), cache=plain_cache)
        mx.eval([c.state for c in plain_cache])
    prompt = mx.random.randint(0, 1000, (max(sizes),)).tolist()

    def back(kv: list) -> None:  # the joiner's cache to the shared context again
        trim_prompt_cache(kv, kv[0].offset - args.context)

    def synced(fn) -> float:
        mx.synchronize(generation_stream)  # (the steps run on mlx-lm's stream, not the default one)
        began = time.perf_counter()
        fn()
        mx.synchronize(generation_stream)
        return 1000 * (time.perf_counter() - began)

    for _ in range(20):
        batch.next()
    plain = statistics.median(synced(batch.next) for _ in range(20))
    print(f"\nplain step, {args.rows} rows of {args.context} tokens: {plain:.1f} ms (to the device's end)\n")

    print("| chunk | alone, mlx-lm's KVCache | alone (prefill) | mixed step | mixed - plain | alone + plain | joiner's first step "
          "| steps as the log sees them: mixed, first, next, next |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for n in sizes:
        chunk = prompt[:n]

        def alone() -> None:
            with mx.stream(generation_stream):
                mx.eval(forward_segments(model, [joiner], mx.array(chunk, dtype=mx.int32), [n])[:, -1])

        t_alone = synced(alone)
        back(joiner)

        def mlx_lm_alone() -> None:
            with mx.stream(generation_stream):
                mx.eval(model(mx.array([chunk]), cache=plain_cache)[:, -1])

        t_mlx_lm = synced(mlx_lm_alone)
        trim_prompt_cache(plain_cache, n)
        t_mixed = synced(lambda: batch.next([(joiner, chunk)]))
        uid = batch.insert(chunk[-1], joiner, 1_000_000, [], None, [])
        t_first = synced(batch.next)
        batch.remove(uid)
        back(joiner)
        # As the engine's log sees it: pipelined steps, each timed on the host alone.
        for _ in range(3):
            batch.next()
        seen = []
        began = time.perf_counter()
        batch.next([(joiner, chunk)])
        seen.append(time.perf_counter() - began)
        uid = batch.insert(chunk[-1], joiner, 1_000_000, [], None, [])
        for _ in range(3):
            began = time.perf_counter()
            batch.next()
            seen.append(time.perf_counter() - began)
        batch.remove(uid)
        mx.synchronize(generation_stream)
        back(joiner)
        print(f"| {n} | {t_mlx_lm:.1f} ms | {t_alone:.1f} ms | {t_mixed:.1f} ms | {t_mixed - plain:.1f} ms | {t_alone + plain:.1f} ms "
              f"| {t_first:.1f} ms | {', '.join(f'{1000 * s:.0f}' for s in seen)} ms |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
