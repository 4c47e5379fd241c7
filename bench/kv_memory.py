"""KV memory: quantised KV (kv_bits 16 / 8 / 4) at long contexts, and memory
during a long generation with and without allocation at admission (issue 25).

What. In-process with the engine's own KV pieces (engine/cache/kv_cache.py:
make_kv, the paced prefill of engine/model/prefill.py with its dequantised view
of a quantised layer, mlx-lm's generate_step for decoding), each arm in a
fresh subprocess so MLX's peak memory is the arm's own:

  context arms   per context (--contexts, default 8192 and 32768) and bits
                 (--bits, default 16, 8, 4): a prompt of that many tokens
                 prefilled into a cache allocated for it and --decode tokens
                 (as a lone request's), then --decode greedy tokens. Reported:
                 TTFT (prefill + first token), decode tok/s, the cache's bytes,
                 peak memory beyond the weights (the KV and what the prefill
                 held beside it), and the context that fits in the 16-bit
                 arm's KV bytes at these bits (the estimate the engine admits by).
  generation     a --generation-token greedy answer (default 4096) after a
                 short prompt, into mlx-lm's own growing cache ("grown", what
                 mlx_lm.server does) and into one allocated at admission
                 ("allocated", mlxd's lone path): MLX's active memory after
                 every token, its growth after the first token, and an SVG
                 plot of both (--plot); the same for a batch of --batch-rows
                 requests (max_concurrency > 1) in mlx-lm's BatchKVCache and
                 in mlxd's, allocated when rows join (engine/cache/batch_kv.py).

The model: --model-dir, or the demo model built from engine/model/demo_model.py's
variant --demo (default "a" on the CPU; "8b" on the GPU, bench/gpu_run.sh).
Random weights: quality is measured elsewhere (bench/kv_quality.py).

    .venv/bin/python bench/kv_memory.py --contexts 2048,8192 --generation 4096
    .venv/bin/python bench/kv_memory.py --model-dir /tmp/models/demo-8b --plot out.svg
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import benchkit as bk  # noqa: E402


# --- pure parts (tested in tests/bench/test_kv_memory_bench.py) -----------------

def growth_after_first(samples: list[int]) -> float:
    """How much memory grew after the first token, as a share of it."""
    if not samples:
        return 0.0
    return (max(samples) - samples[0]) / samples[0]


def steps_seen(samples: list[int], min_jump: int) -> int:
    """Times memory jumped up by at least `min_jump` bytes between tokens: the staircase's steps."""
    return sum(1 for a, b in zip(samples, samples[1:]) if b - a >= min_jump)


def contexts_in(budget_bytes: int, bytes_at: Any, start: int = 256, step: int = 256) -> int:
    """The longest context (in `step`s) whose bytes, per `bytes_at(n)`, fit `budget_bytes`."""
    n = start
    while bytes_at(n + step) <= budget_bytes:
        n += step
    return n


def context_rows(arms: list[dict]) -> list[list[str]]:
    """The context arms as table rows, with each arm's figures beside its
    context's 16-bit arm."""
    base = {a["context"]: a for a in arms if a["bits"] == 16}
    rows = []
    for a in sorted(arms, key=lambda a: (a["context"], -a["bits"])):
        ref = base.get(a["context"])
        ratio = (lambda k: f"{a[k] / ref[k]:.2f}x" if ref and ref.get(k) else "-")
        rows.append([str(a["context"]), str(a["bits"]), f"{a['kv_bytes'] / 2**20:.0f}",
                     f"{a['peak_beyond_weights'] / 2**20:.0f}", ratio("peak_beyond_weights"),
                     f"{a['ttft_s']:.2f}", f"{a['decode_tok_s']:.1f}", ratio("decode_tok_s"),
                     f"{a['fits_context_x']:.2f}x"])
    return rows


CONTEXT_HEADER = ["context", "kv bits", "KV MiB", "peak beyond weights MiB", "x 16-bit", "TTFT s",
                  "decode tok/s", "x 16-bit", "context in 16-bit's KV bytes"]


def svg_plot(series: dict[str, list[int]], width: int = 720, height: int = 300) -> str:
    """A line plot of memory (MiB) per generated token, one polyline a series."""
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"]
    n = max(len(s) for s in series.values())
    lo = min(min(s) for s in series.values())
    hi = max(max(s) for s in series.values())
    span = max(hi - lo, 1)
    left, right, top, bottom = 70, 20, 20, 40
    w, h = width - left - right, height - top - bottom

    def point(i: int, v: int) -> str:
        return f"{left + w * i / max(n - 1, 1):.1f},{top + h * (1 - (v - lo) / span):.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="black"/>',
           f'<text x="{left + w / 2}" y="{height - 8}" text-anchor="middle">generated tokens (0 to {n})</text>',
           f'<text x="4" y="{top + 10}">{hi / 2**20:.0f} MiB</text>',
           f'<text x="4" y="{top + h}">{lo / 2**20:.0f} MiB</text>']
    for k, (name, samples) in enumerate(series.items()):
        stride = max(1, len(samples) // 800)
        pts = " ".join(point(i, v) for i, v in enumerate(samples) if i % stride == 0 or i == len(samples) - 1)
        color = colors[k % len(colors)]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>')
        out.append(f'<text x="{left + 10}" y="{top + 16 + 16 * k}" fill="{color}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


# --- one arm, in its own process -------------------------------------------------

def _prompt(vocab: int, n: int) -> list[int]:
    """n token ids, deterministic, spread over the vocabulary (random weights: any text is as good)."""
    return [(i * 7919 + 13) % (vocab - 10) + 5 for i in range(n)]


def run_arm(spec: dict) -> dict:
    from mlxd.engine.cpu import fast_blas

    fast_blas.activate()
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from mlxd.engine.model.prefill import prefill
    from mlxd.engine.cache.kv_cache import make_kv, prefill_views, quantized_decode_works
    from mlxd.engine.model.prefill_pace import PrefillPace
    from mlxd.memory_estimate import KVLayout, kv_cache_bytes

    model, tokenizer = load(spec["model_dir"])
    mx.eval(model.parameters())
    weights = mx.get_active_memory()
    vocab = model.args.vocab_size
    layout = KVLayout(spec["bits"], spec["group_size"], 0) if spec["bits"] < 16 else KVLayout()
    quantize = ({"kv_bits": layout.bits, "kv_group_size": layout.group_size, "quantized_kv_start": 0}
                if layout.quantized else {})
    dequantized = layout.quantized and not quantized_decode_works(model, layout)
    # Warm-up: MLX's CUDA backend compiles kernels at first use; not the arm's time.
    warm = make_kv(model, 600, layout)
    prefill(model, warm, _prompt(vocab, 520), PrefillPace(512, 1e9, first=512), lambda: None, None, layout)
    for _ in zip(range(4), generate_step(mx.array(_prompt(vocab, 1)), model, max_tokens=4,
                                         prompt_cache=prefill_views(warm) if dequantized else warm)):
        pass
    del warm
    mx.clear_cache()
    mx.reset_peak_memory()
    if spec["kind"] == "generation":
        prompt = _prompt(vocab, spec["prompt"])
        n = spec["tokens"]
        kv = make_kv(model, len(prompt) + n, layout) if spec["allocated"] else make_prompt_cache(model)
        samples = []
        for _, _ in zip(range(n), generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=kv, **quantize)):
            samples.append(mx.get_active_memory())
        return {"samples": samples, "weights": weights, "peak": mx.get_peak_memory()}
    if spec["kind"] == "batch_generation":  # max_concurrency > 1: mlx-lm's BatchGenerator, as mlxd ran it before its own batch
        from mlx_lm.generate import BatchGenerator

        from mlx_lm_batch_kv import rows_for_batch

        n, rows = spec["tokens"], spec["rows"]
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=rows, prefill_batch_size=rows)
        for r in range(rows):
            prompt = _prompt(vocab, spec["prompt"] + 17 * r)
            kv = make_prompt_cache(model)
            kv = rows_for_batch(kv, len(prompt), n) if spec["allocated"] else kv
            gen.insert_segments([[prompt]], max_tokens=[n], caches=[kv])
        samples, made = [], 0
        while made < rows * n:
            _, responses = gen.next()
            made += len(responses)
            if responses:
                samples.append(mx.get_active_memory())
        gen.close()
        return {"samples": samples, "weights": weights, "peak": mx.get_peak_memory()}
    context, decode = spec["context"], spec["decode"]
    prompt = _prompt(vocab, context)
    kv = make_kv(model, context + decode, layout)
    began = time.perf_counter()
    prefill(model, kv, prompt[:-1], PrefillPace(spec["prefill_step"], 1e9, first=spec["prefill_step"]),
            lambda: None, None, layout)
    # As the engine decodes (engine/model/generation.py): over the quantised KV where
    # this MLX can, else over it dequantised a layer at a time.
    steps = generate_step(mx.array(prompt[-1:]), model, max_tokens=decode,
                          prompt_cache=prefill_views(kv) if dequantized else kv, **({} if dequantized else quantize))
    first = next(steps)
    mx.eval(first[0])
    ttft = time.perf_counter() - began
    began = time.perf_counter()
    count = sum(1 for _ in steps)
    decode_s = time.perf_counter() - began
    config = json.loads((Path(spec["model_dir"]) / "config.json").read_text())
    return {"context": context, "bits": spec["bits"], "ttft_s": ttft, "dequantized_decode": dequantized,
            "decode_tok_s": count / decode_s if decode_s > 0 else 0.0,
            "kv_bytes": sum(c.nbytes for c in kv), "peak_beyond_weights": mx.get_peak_memory() - weights,
            "estimate_bytes": kv_cache_bytes(config, context + decode, layout=layout)}


def in_subprocess(spec: dict, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, __file__, "--arm", json.dumps(spec), "--arm-out", out.name]
        subprocess.run(cmd, check=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return json.loads(Path(out.name).read_text())


# --- the run ---------------------------------------------------------------------

def model_folder(args: argparse.Namespace) -> str:
    if args.model_dir:
        return args.model_dir
    from mlxd.engine.model.demo_model import build_demo_model

    return str(build_demo_model(Path(tempfile.gettempdir()) / f"mlxd-bench-demo-{args.demo}", args.demo,
                                progress=bk.say))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="a model folder (default: the demo model --demo, built once)")
    ap.add_argument("--demo", default="a", help="demo model variant when no --model-dir (a, b, 8b)")
    ap.add_argument("--contexts", default="8192,32768", help="comma-separated context lengths")
    ap.add_argument("--bits", default="16,8,4", help="comma-separated kv_bits")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded after each context's prompt")
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--generation", type=int, default=4096, help="tokens of the long generation (0: skip)")
    ap.add_argument("--generation-prompt", type=int, default=256)
    ap.add_argument("--batch-rows", type=int, default=2, help="requests of the batched generation arms (< 2: skip)")
    ap.add_argument("--timeout", type=float, default=1800, help="per arm, seconds")
    ap.add_argument("--plot", help="write the generation's memory plot (SVG) here")
    ap.add_argument("--json-out", help="write every figure here")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--arm-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arm:
        Path(args.arm_out).write_text(json.dumps(run_arm(json.loads(args.arm))))
        return 0

    folder = model_folder(args)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    bits = [int(b) for b in args.bits.split(",") if b]
    config = json.loads((Path(folder) / "config.json").read_text())
    from mlxd.memory_estimate import KVLayout, kv_cache_bytes

    results: dict[str, Any] = {"model_dir": folder, "machine": bk.machine_info(), "contexts": [], "generation": {}}
    for context in contexts:
        for b in bits:
            bk.say(f"context {context}, kv_bits {b}")
            arm = in_subprocess({"kind": "context", "model_dir": folder, "context": context, "bits": b,
                                 "group_size": args.group_size, "decode": args.decode,
                                 "prefill_step": args.prefill_step}, args.timeout)
            layout = KVLayout(b, args.group_size) if b < 16 else KVLayout()
            budget = kv_cache_bytes(config, context)
            arm["fits_context_x"] = contexts_in(budget, lambda n: kv_cache_bytes(config, n, layout=layout)) / context
            bk.say(f"  TTFT {arm['ttft_s']:.2f} s, decode {arm['decode_tok_s']:.1f} tok/s, "
                   f"KV {arm['kv_bytes'] / 2**20:.0f} MiB, peak beyond weights {arm['peak_beyond_weights'] / 2**20:.0f} MiB")
            results["contexts"].append(arm)
    if args.generation:
        arms = [("grown (mlx-lm's cache)", "generation", False), ("allocated at admission (mlxd)", "generation", True)]
        if args.batch_rows > 1:
            arms += [(f"batch of {args.batch_rows}, grown (mlx-lm's BatchKVCache)", "batch_generation", False),
                     (f"batch of {args.batch_rows}, allocated when rows join (mlxd)", "batch_generation", True)]
        for name, kind, allocated in arms:
            bk.say(f"generation of {args.generation} tokens, {name}")
            arm = in_subprocess({"kind": kind, "model_dir": folder, "bits": 16, "group_size": args.group_size,
                                 "prompt": args.generation_prompt, "tokens": args.generation,
                                 "allocated": allocated, "rows": args.batch_rows}, args.timeout)
            step_kv = kv_cache_bytes(config, 256)
            arm["growth_after_first"] = growth_after_first(arm["samples"])
            arm["steps"] = steps_seen(arm["samples"], step_kv // 2)
            bk.say(f"  growth after the first token {100 * arm['growth_after_first']:.2f} %, "
                   f"{arm['steps']} steps up")
            results["generation"][name] = arm
    print()
    if results["contexts"]:
        print(bk.md_table(CONTEXT_HEADER, context_rows(results["contexts"])))
    if results["generation"]:
        print()
        print(bk.md_table(["generation", "tokens", "memory after 1st token MiB", "max MiB", "growth", "steps up"],
                       [[name, str(len(a["samples"])), f"{a['samples'][0] / 2**20:.1f}",
                         f"{max(a['samples']) / 2**20:.1f}", f"{100 * a['growth_after_first']:.2f} %",
                         str(a["steps"])] for name, a in results["generation"].items()]))
        if args.plot:
            Path(args.plot).write_text(svg_plot({n: a["samples"] for n, a in results["generation"].items()}))
            bk.say(f"plot: {args.plot}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
