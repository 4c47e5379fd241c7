#!/usr/bin/env python3
"""Diagnosis (not a benchmark): how fast long prompts are prefilled, alone and
in a batch, on one model, in process, no server (issue 35, item 5).

Each way prefills the same prompts until every row has its first token:

  alone        one row at a time through the model in steps (engine/model/prefill.py's way),
               the rows one after another
  mlx-lm       mlx-lm's BatchGenerator, every row a new row, mlx-lm's own caches
  engine       as mlxd's batch does (engine/model/batch_decoder.py): each row prefilled alone a paced chunk at a time
               (engine/model/prefill.py), joining mlx-lm's batch with its last token (engine/cache/batch_kv.py's caches),
               a decode step of the joined rows after every chunk

With --cached C every row's KV first holds C tokens of its own (prefilled
untimed: a conversation taken from the prompt cache) and the timed part is
the turn's new --prompt-tokens: an agent's later turn.

Per way: prompt tokens per second (median of --repeats), and the last
repeat's steps (time, rows).

  python bench/long_prefill_probe.py MODEL [--rows 4] [--prompt-tokens 12000] [--cached 0] [--step 512]
      [--ways alone,mlx-lm,engine] [--repeats 2]
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
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=12000)
    p.add_argument("--cached", type=int, default=0, help="tokens each row's KV holds before the timed part")
    p.add_argument("--step", type=int, default=512, help="prefill_step_size")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ways", default="alone,mlx-lm,engine")
    p.add_argument("--as-engine", action="store_true",
                   help="the engine's process set-up: its BLAS choice first, the model through load_resident")
    p.add_argument("--memory-limit-gib", type=float, default=None, help="mx.set_memory_limit, as the engine sets it")
    p.add_argument("--in-thread", action="store_true", help="load and run on a thread of its own (the worker's way)")
    args = p.parse_args(argv)
    if args.in_thread:
        import threading

        result: list[int] = []
        args.in_thread = False
        worker = threading.Thread(target=lambda: result.append(main_with(args)))
        worker.start()
        worker.join()
        return result[0] if result else 1
    return main_with(args)


def main_with(args: argparse.Namespace) -> int:
    if args.as_engine:
        from mlxd.engine.cpu import fast_blas

        print(fast_blas.activate().why)

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_batch_kv import rows_for_batch

    if args.memory_limit_gib:
        mx.set_memory_limit(int(args.memory_limit_gib * 2**30))
    if args.as_engine:
        from mlxd.engine.model.model_load import load_resident

        resident = load_resident("probe", args.model)
        model, tokenizer = resident.model, resident.tokenizer
    else:
        model, tokenizer = load(args.model)
    eos = sorted(tokenizer.eos_token_ids)
    rng = random.Random(1)
    vocab = min(tokenizer.vocab_size, 30000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    def prefilled(context: list[int]) -> list[Any]:
        kv = make_prompt_cache(model)
        for a in range(0, len(context), args.step):
            model(mx.array(context[a:a + args.step])[None], cache=kv)
            mx.eval([c.state for c in kv])
        return kv

    def run(way: str) -> tuple[float, list[str]]:
        contexts = [tokens(args.cached) for _ in range(args.rows)]
        prompts = [tokens(args.prompt_tokens) for _ in range(args.rows)]
        caches = [prefilled(c) if args.cached else make_prompt_cache(model) for c in contexts]
        mx.synchronize()
        steps: list[str] = []
        began = time.perf_counter()
        if way == "alone":
            for kv, prompt in zip(caches, prompts):
                for a in range(0, len(prompt), args.step):
                    t = time.perf_counter()
                    model(mx.array(prompt[a:a + args.step])[None], cache=kv)
                    mx.eval([c.state for c in kv])
                    steps.append(f"{1000 * (time.perf_counter() - t):.0f}")
            return time.perf_counter() - began, steps
        gen = BatchGenerator(model, stop_tokens=[[t] for t in eos], completion_batch_size=args.rows,
                             prefill_batch_size=args.rows, prefill_step_size=args.step)
        uids: list[int] = []
        firsts: set[int] = set()
        if way == "engine":
            from mlxd.engine.model.prefill import prefill
            from mlxd.engine.model.prefill_pace import PrefillPace

            pace = PrefillPace(args.step, 100.0)
            for kv, context, prompt in zip(caches, contexts, prompts):
                done = 0
                while done < len(prompt) - 1:
                    chunk = prompt[done:min(done + pace.step(), len(prompt) - 1)]
                    t = time.perf_counter()
                    prefill(model, kv, chunk, pace, lambda: None)
                    steps.append(f"{1000 * (time.perf_counter() - t):.0f}p")
                    done += len(chunk)
                    if uids:  # the joined rows decode between chunks
                        firsts.update(r.uid for r in gen.next()[1])
                kv = rows_for_batch(kv, 1, args.max_tokens)
                (uid,) = gen.insert_segments([[prompt[-1:]]], max_tokens=[args.max_tokens], caches=[kv],
                                             all_tokens=[context + prompt[:-1]])
                uids.append(uid)
        else:
            for kv, context, prompt in zip(caches, contexts, prompts):
                (uid,) = gen.insert_segments([[prompt]], max_tokens=[args.max_tokens], caches=[kv],
                                             all_tokens=[context])
                uids.append(uid)
        while len(firsts) < len(uids):
            t = time.perf_counter()
            prompt_responses, responses = gen.next()
            steps.append(f"{1000 * (time.perf_counter() - t):.0f}/{len(prompt_responses)}r")
            firsts.update(r.uid for r in responses)
        gen.close()
        return time.perf_counter() - began, steps

    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    speeds: dict[str, list[float]] = {w: [] for w in ways}
    last_steps: dict[str, list[str]] = {}
    total = args.rows * args.prompt_tokens
    for way in ways:  # warm-up: shapes compiled once
        run(way)
    for r in range(args.repeats):
        for way in ways[r % len(ways):] + ways[:r % len(ways)]:
            seconds, steps = run(way)
            speeds[way].append(total / seconds)
            last_steps[way] = steps
            print(f"  {way}: {total / seconds:.0f} tok/s", file=sys.stderr, flush=True)
    print(f"{args.rows} rows x {args.prompt_tokens} new tokens over {args.cached} cached, prefill_step_size "
          f"{args.step}, as engine {args.as_engine}, memory limit {args.memory_limit_gib} GiB, {mx.default_device()}, peak {mx.get_peak_memory() / 2**30:.1f} GiB")
    for way in ways:
        print(f"{way:8s} {statistics.median(speeds[way]):8.0f} prompt tok/s "
              f"(all: {', '.join(f'{s:.0f}' for s in speeds[way])})")
        shown = last_steps[way]
        print(f"         steps (ms): {' '.join(shown[:6])} ... {' '.join(shown[-4:])} ({len(shown)} steps)")
    return 0


if __name__ == "__main__":
    import os

    code = main()
    sys.stdout.flush()
    os._exit(code)  # MLX's CUDA backend can abort in its static destructors after a thread ran it
