#!/usr/bin/env python3
"""Diagnosis (not a benchmark): where a burst of requests' first tokens go
in mlx-lm's BatchGenerator, on one model, in process, no server.

A burst of N distinct prompts (~P tokens each) until every row has its first
token, four ways, each R times after a warm-up, the ways rotated:

  engine       as mlxd's batched worker serves a burst: the first request
               prefilled alone (its KV in a KVCache), joining the batch with
               its last token; the others as new rows; the engine's caches
               (engine/cache/batch_kv.py: rows allocated for their grants)
  engine-flat  the same caches, every request a new row (no lone start)
  mlx-lm-solo  the lone start with mlx-lm's own caches
  mlx-lm       mlx-lm's caches, every request a new row (mlx_lm.server)

Per way: the time to the last first token (median), and each BatchGenerator
step's time, prompt tokens and rows (the last repeat).

  python bench/batch_join_probe.py MODEL [--burst 4] [--prompt-tokens 1013] [--step 512] [--repeats 3]
      [--spread 3] [--as-engine] [--in-thread | --load-in-thread] [--idle 1.5] [--clear-cache]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--burst", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1013)
    p.add_argument("--spread", type=int, default=0,
                   help="prompts shorter by 0..SPREAD tokens, drawn per prompt (a burst of real prompts is ragged)")
    p.add_argument("--step", type=int, default=512, help="prefill_step_size (mlxd's default 512)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ways", default="engine,engine-flat,mlx-lm-solo,mlx-lm")
    p.add_argument("--as-engine", action="store_true",
                   help="the engine's process set-up: its BLAS choice first, the model through load_resident")
    p.add_argument("--in-thread", action="store_true", help="the bursts run on a thread of their own (the engine's "
                   "worker is one), the model loaded on the main thread")
    p.add_argument("--load-in-thread", action="store_true",
                   help="the model loaded and the bursts run on one thread of their own (as the engine's worker does)")
    p.add_argument("--idle", type=float, default=0.0,
                   help="seconds the GPU stays idle before each burst (a served benchmark's pause between rounds)")
    p.add_argument("--clear-cache", action="store_true", help="mx.clear_cache() after the lone prefill's steps")
    args = p.parse_args(argv)

    if args.as_engine:
        from mlxd.engine.cpu import fast_blas

        print(fast_blas.activate().why)
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_batch_kv import rows_for_batch

    loaded: dict[str, Any] = {}

    def load_model() -> None:
        if args.as_engine:
            from mlxd.engine.model.model_load import load_resident

            resident = load_resident("probe", args.model)
            loaded["model"], loaded["tokenizer"] = resident.model, resident.tokenizer
        else:
            loaded["model"], loaded["tokenizer"] = load(args.model)

    if not args.load_in_thread:
        load_model()
    rng = random.Random(1)

    def burst() -> list[list[int]]:
        vocab = min(loaded["tokenizer"].vocab_size, 30000)
        return [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens - rng.randint(0, args.spread))]
                for _ in range(args.burst)]

    def run(way: str) -> tuple[float, list[str]]:
        prompts = burst()
        time.sleep(args.idle)
        model, eos = loaded["model"], sorted(loaded["tokenizer"].eos_token_ids)
        ours = way.startswith("engine")
        solo = way in ("engine", "mlx-lm-solo")
        gen = BatchGenerator(model, stop_tokens=[[t] for t in eos], completion_batch_size=8, prefill_batch_size=8,
                             prefill_step_size=args.step)
        began = time.perf_counter()
        uids = []
        for i, prompt in enumerate(prompts):
            kv = make_prompt_cache(model)
            segment = prompt
            if solo and i == 0:  # prefilled alone in steps, as engine/model/prefill.py does
                for a in range(0, len(prompt) - 1, args.step):
                    model(mx.array(prompt[a:min(a + args.step, len(prompt) - 1)])[None], cache=kv)
                    mx.eval([c.state for c in kv])
                    if args.clear_cache:
                        mx.clear_cache()
                segment = prompt[-1:]
            if ours:
                kv = rows_for_batch(kv, len(segment), args.max_tokens)
            (uid,) = gen.insert_segments([[segment]], max_tokens=[args.max_tokens], caches=[kv],
                                         all_tokens=[prompt[:len(prompt) - len(segment)]])
            uids.append(uid)
        firsts: dict[int, float] = {}
        steps = []
        while len(firsts) < len(uids):
            t = time.perf_counter()
            prompt_responses, responses = gen.next()
            dt = time.perf_counter() - t
            tokens = sum(1 for _ in prompt_responses)
            steps.append(f"{1000 * dt:.1f} ms ({tokens} prompt rows, {len(responses)} decoded)")
            for r in responses:
                firsts.setdefault(r.uid, time.perf_counter() - began)
        gen.close()
        return max(firsts.values()), steps

    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    times: dict[str, list[float]] = {w: [] for w in ways}
    last_steps: dict[str, list[str]] = {}

    def all_runs() -> None:
        for way in ways:  # warm-up: shapes compiled once
            run(way)
        for r in range(args.repeats):
            for way in ways[r % len(ways):] + ways[:r % len(ways)]:
                t, steps = run(way)
                times[way].append(t)
                last_steps[way] = steps

    if args.in_thread or args.load_in_thread:
        import threading

        worker = threading.Thread(target=lambda: (load_model() if args.load_in_thread else None, all_runs()))
        worker.start()
        worker.join()
    else:
        all_runs()
    print(f"burst of {args.burst} x {args.prompt_tokens} tokens, prefill_step_size {args.step}, "
          f"{mx.default_device()}")
    for way in ways:
        print(f"{way:12s} last first token {1000 * statistics.median(times[way]):7.1f} ms "
              f"(all: {', '.join(f'{1000 * t:.0f}' for t in times[way])})")
        print("             steps: " + "; ".join(last_steps[way][:8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
