"""Where a finishing turn's store stalls the batch (a diagnosis, by hand, on
the lent GPU): four rows of long context decode in mlxd's RowBatch, in
process, and between two steps one of a turn's store's parts runs as the
engine runs it -- a row's KV copied to its length (`fitted`, the memory
tier's entry), its blocks staged for the disk tier (`stage_blocks`) and
written by a real KVWriter thread -- each with the MLX buffer cache as it
is, or cleared first. Printed: the part's own time on the worker, the next
step's, and the steps' time above their median over the next 40 steps (the
stall the decoding rows see, the writer's read included).

    python bench/store_stall_probe.py MODEL_DIR [--context 16384] [--rows 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--after", type=int, default=40, help="steps watched after each part")
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load

    from mlxd.engine.cache.kv_blocks import block_spans, stage_blocks
    from mlxd.engine.cache.kv_cache import fitted, make_kv
    from mlxd.engine.cache.kv_writer import KVWriter, StagedWrite
    from mlxd.engine.model.row_attention import route_attention
    from mlxd.engine.model.row_batch import RowBatch
    from mlxd.memory_estimate import KVLayout

    model, _ = load(str(args.model))
    route_attention()
    batch = RowBatch(model, frozenset())
    mx.random.seed(0)
    for r in range(args.rows):
        kv = make_kv(model, args.context + 4096, KVLayout())
        tokens = mx.random.randint(0, 1000, (args.context,)).tolist()
        for start in range(0, args.context - 1, 2048):
            model(mx.array([tokens[start:min(start + 2048, args.context - 1)]]), cache=kv)
            mx.eval([c.state for c in kv])
        batch.insert(tokens[-1], kv, 100_000, tokens[:-1], None, [])
        print(f"row {r} prefilled ({args.context} tokens)", flush=True)
    for _ in range(20):
        batch.next()
    folder = Path(tempfile.mkdtemp(prefix="mlxd-stall-"))
    writer = KVWriter()

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            began = time.perf_counter()
            batch.next()
            out.append(time.perf_counter() - began)
        return out

    def fit() -> None:
        mx.eval([a for c in fitted(batch.rows[0].kv) for a in c.state[:2]])

    def staged() -> list:
        kv = batch.rows[0].kv
        spans = [s for s in block_spans(args.context - 1) if s[1] - s[0] == 256]
        return stage_blocks([(folder / f"b{time.monotonic_ns()}-{i}.st", folder / f"t{i}") for i in range(len(spans))],
                            kv, spans, {"model": "probe"})

    def stage() -> None:
        writer.submit(StagedWrite(staged()))

    def stage_only() -> None:  # the device copies, nobody reading them to the host
        held.append(staged())

    held: list = []

    base = statistics.median(steps(40))
    print(f"\nplain step median {1000 * base:.1f} ms ({args.rows} rows, {args.context} tokens each)\n")
    print("| part | buffer cache | MLX cache before | part on the worker | next step | steps over median, next "
          f"{args.after} (longest) |")
    print("|---|---|---:|---:|---:|---:|")
    for name, part in (("fitted copy of a row", fit), ("stage its blocks, no writer", stage_only),
                       ("stage its blocks + writer", stage)):
        for clear in (False, True):
            for _ in range(2):
                if clear:
                    mx.clear_cache()
                cached = mx.get_cache_memory()
                began = time.perf_counter()
                part()
                took = time.perf_counter() - began
                after = steps(args.after)
                writer.finished(block=True, timeout=60)
                held.clear()
                over = sum(max(0.0, s - base) for s in after)
                print(f"| {name} | {'cleared' if clear else 'as is'} | {cached >> 20} MiB | {1000 * took:.0f} ms "
                      f"| {1000 * after[0]:.0f} ms | {1000 * over:.0f} ms ({1000 * max(after):.0f} ms) |", flush=True)
    writer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
