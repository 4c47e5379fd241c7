"""Where a reused KV cache's time goes, in one process on mlx-lm alone (no engine).

A diagnosis run, by hand, for the prompt-cache figures that bench/prompt_cache.py
reports through the engine: it separates MLX/mlx-lm behaviour from mlxd's. On
one model it grows an agent-style conversation turn by turn and, per turn, times
per decode step (median, p90, max) for:
  fresh     a new cache, the whole prompt prefilled
  reuse     one cache carried across turns (what the prompt cache does in memory)
  compact   the same, but its arrays copied to hold just the covered tokens before
            each turn (what the engine does since this run)
  burn      as compact, after a 4096-token prefill into a throwaway cache: does
            decode speed depend on what the GPU did just before?
  aligned   as compact, into a buffer whose length is a multiple of KVCache.step
            with room for the turn's new tokens (a fresh cache's buffers always
            are; a continued one's are not once it grows from an odd offset)
  disk      the carried cache saved and loaded back (what a restarted engine does)
and, for the disk arm, the write, the load and the first forward after a load.
The arms run in a rotating order, so a drift (GPU clocks) does not favour one;
where nvidia-smi is there, each decode's mean SM clock is recorded too.

    python bench/kv_reuse_profile.py MODEL [--prompt-tokens 12288] [--turns 6]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.sample_utils import make_sampler


def turn(model, cache, new_tokens, max_tokens):
    """Feed new_tokens into cache and decode; returns (ttft_s, step_s list, tokens)."""
    greedy = make_sampler(0.0)
    steps, out = [], []
    t0 = time.perf_counter()
    ttft = None
    last = t0
    decode_from = None
    for tok, _ in generate_step(mx.array(new_tokens), model, max_tokens=max_tokens,
                                sampler=greedy, prompt_cache=cache):
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
            decode_from = now
        else:
            steps.append(now - last)
        last = now
        out.append(int(tok))
    return ttft, steps, out, (decode_from, last)


def summary(steps):
    s = sorted(steps)
    return {"median_ms": 1e3 * statistics.median(s), "p90_ms": 1e3 * s[int(0.9 * (len(s) - 1))],
            "max_ms": 1e3 * s[-1], "tok_s": len(s) / sum(s)}


def aligned(cache, room):
    out = []
    for c in cache:
        if type(c) is KVCache and c.keys is not None:
            o = c.offset
            length = -(-(o + room) // c.step) * c.step
            k = mx.zeros((*c.keys.shape[:2], length, c.keys.shape[3]), c.keys.dtype)
            v = mx.zeros((*c.values.shape[:2], length, c.values.shape[3]), c.values.dtype)
            k[..., :o, :] = c.keys[..., :o, :]
            v[..., :o, :] = c.values[..., :o, :]
            c = KVCache.from_state((k, v, o))
            mx.eval(c.keys, c.values)
        out.append(c)
    return out


def compact(cache):
    out = []
    for c in cache:
        if type(c) is KVCache and c.keys is not None:
            o = c.offset
            c = KVCache.from_state((mx.contiguous(c.keys[..., :o, :]), mx.contiguous(c.values[..., :o, :]), o))
            mx.eval(c.keys, c.values)
        out.append(c)
    return out


class ClockLog:
    """SM clock samples from nvidia-smi every 50 ms (none where it is missing)."""

    def __init__(self):
        self.samples = []
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                                          "-lms", "50"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip())))
            except ValueError:
                pass

    def mean(self, t0, t1):
        xs = [c for t, c in list(self.samples) if t0 <= t <= t1]
        return statistics.mean(xs) if xs else None

    def stop(self):
        if self.proc:
            self.proc.terminate()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=12288)
    ap.add_argument("--turn-tokens", type=int, default=300)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()

    model, _ = load(args.model)
    vocab = model.args.vocab_size if hasattr(model, "args") else 32000
    rng = np.random.default_rng(0)
    words = lambda n: rng.integers(100, min(vocab, 30000), n).tolist()  # noqa: E731

    # Warm-up: kernels for a mid-size prefill and decode.
    turn(model, make_prompt_cache(model), words(1024), 8)

    prompt = words(args.prompt_tokens)
    arms = ["fresh", "reuse", "compact", "aligned", "burn", "disk"]
    carried = {a: make_prompt_cache(model) for a in arms[1:]}
    fed = {k: 0 for k in carried}  # tokens each carried cache holds (its offset)
    rows = []
    tmp = tempfile.mkdtemp()
    clocks = ClockLog()
    answer = None
    for t in range(1, args.turns + 1):
        row = {"turn": t, "prompt_tokens": len(prompt)}
        order = arms[(t - 1) % len(arms):] + arms[:(t - 1) % len(arms)]
        row["order"] = order
        for arm in order:
            if arm == "fresh":
                ttft, steps, ans, (d0, d1) = turn(model, make_prompt_cache(model), prompt, args.max_tokens)
                row["fresh"] = {"ttft_s": ttft, **summary(steps), "sm_mhz": clocks.mean(d0, d1)}
                answer = answer or ans
                continue
            cache = carried[arm]
            extra = {}
            if arm in ("compact", "burn") and t > 1:
                t0 = time.perf_counter()
                cache = carried[arm] = compact(cache)
                extra["compact_s"] = time.perf_counter() - t0
            if arm == "aligned" and t > 1:
                cache = carried[arm] = aligned(cache, len(prompt) - fed[arm])
            if arm == "burn":
                throwaway = make_prompt_cache(model)
                mx.eval(model(mx.array(words(4096))[None], cache=throwaway))
                del throwaway
            if arm == "disk" and t > 1:
                path = os.path.join(tmp, "kv.safetensors")
                t0 = time.perf_counter()
                save_prompt_cache(path, compact(cache), {"n": str(fed[arm])})
                extra["write_s"] = time.perf_counter() - t0
                extra["bytes"] = os.path.getsize(path)
                t0 = time.perf_counter()
                with open(path, "rb") as fh:
                    while fh.read(1 << 26):
                        pass
                extra["raw_read_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                cache = carried[arm] = load_prompt_cache(path)
                extra["load_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                mx.eval([c.state for c in cache])
                extra["eval_after_load_s"] = time.perf_counter() - t0
            new = prompt[fed[arm]:]
            ttft, steps, ans, (d0, d1) = turn(model, cache, new, args.max_tokens)
            fed[arm] = cache[0].offset
            row[arm] = {"ttft_s": ttft, "fed": len(new), **summary(steps), **extra,
                        "sm_mhz": clocks.mean(d0, d1)}
            answer = answer or ans
        rows.append(row)
        print(json.dumps(row), flush=True)
        prompt = prompt + answer + words(args.turn_tokens)
        answer = None
    clocks.stop()
    print("turn  tokens  " + "  ".join(f"{a:>27}" for a in arms))
    for r in rows:
        cells = [f"{r[a]['ttft_s']*1e3:6.0f}ms {r[a]['median_ms']:5.2f}/{r[a]['max_ms']:5.1f} "
                 f"{r[a]['sm_mhz'] or 0:4.0f}" for a in arms]
        print(f"{r['turn']:4d}  {r['prompt_tokens']:6d}  " + "  ".join(f"{c:>27}" for c in cells))
    print("cells: TTFT, decode step median/max ms, mean SM MHz while decoding; order rotates per turn")
    for a in arms:
        later = [r[a] for r in rows if r["turn"] > 1]
        print(f"{a:>8}: turns 2+: TTFT median {statistics.median(x['ttft_s'] for x in later)*1e3:.0f} ms, "
              f"decode median {statistics.median(x['tok_s'] for x in later):.1f} tok/s")


if __name__ == "__main__":
    main()
