#!/usr/bin/env python3
"""Speculative decoding (issue 37): decode speed with prompt lookup against
without, on an agent's edit (the model re-emits a file from its prompt with a
small change; a tool call whose arguments echo the context) and on free chat
(the control: nothing to copy), side by side in one run.

One `mlxd engine` per arm (`[engine] speculative = "off"` / "prompt_lookup",
and with `--draft` a third whose model has that draft model), all up for the whole run, the arms alternating request by request (rotated
each round). Greedy, streamed; per request: TTFT, decode tokens a second
after the first token, the answer (the arms' answers must be identical), and
from /metrics what prompt lookup proposed and had accepted.

  .venv/bin/python bench/speculative.py                    # the default model (SmolLM2-135M), CPU
  .venv/bin/python bench/speculative.py --model PATH       # an mlx-lm model folder
  .venv/bin/python bench/speculative.py --quick            # 1 round, 64 tokens: a smoke test
  .venv/bin/python bench/speculative.py --clients 4        # 4 requests at once an arm (max_concurrency 4):
                                                           #   aggregate tok/s, the batch's case
  .venv/bin/python bench/speculative.py --verify-cost      # in process: a forward of k + 1 tokens against
                                                           #   one decode step (what bounds the gain), no server

`--verify-cost` loads the model as the engine does (the CPU's float32 path on a
machine without Metal or CUDA), prefills `--context` tokens and times forwards
of 1, 2, 3, 5, 9 and 17 tokens over it (median of `--reps`, the KV cut back
after each): a verify of k proposed tokens is a forward of k + 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import (RESULTS, machine_info, say, start_engine, stop_all_children, stream_chat,  # noqa: E402
                      write_json)

ARMS = ("off", "prompt_lookup", "draft")  # draft: with --draft only

SOURCE = '''import json
import os
from pathlib import Path


DEFAULTS = {"host": "127.0.0.1", "port": 8080, "workers": 2, "log_level": "info"}


def load_config(path: Path) -> dict:
    """The settings in `path`, over the defaults."""
    settings = dict(DEFAULTS)
    if path.exists():
        with path.open() as f:
            settings.update(json.load(f))
    for key in DEFAULTS:
        value = os.environ.get("APP_" + key.upper())
        if value is not None:
            settings[key] = type(DEFAULTS[key])(value)
    return settings


def describe(settings: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(settings.items()))


def main() -> int:
    settings = load_config(Path("app.json"))
    print(describe(settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
'''

WORKLOADS = {
    "edit": [{"role": "system", "content": "You are a coding agent. Answer with code only."},
             {"role": "user", "content": f"Here is app.py:\n```python\n{SOURCE}```\nRewrite the whole file with the "
                                         "function load_config renamed to read_config. Output the complete file."}],
    "tool_args": [{"role": "system", "content": "You are a coding agent. You call tools by writing JSON."},
                  {"role": "user", "content": f"Here is app.py:\n```python\n{SOURCE}```\nWrite the JSON arguments of "
                                              "an edit_file call that replaces the body of describe with the same "
                                              "code plus a trailing period: {\"path\": ..., \"old\": ..., \"new\": ...}"}],
    "chat": [{"role": "user", "content": "Write a short story about a lighthouse keeper who befriends a seal."}],
    "json": [{"role": "user", "content": f"Here is app.py:\n```python\n{SOURCE}```\nDescribe each function of it."}],
}
# A bound answer (structured outputs): the grammar forces the keys and the JSON around them.
FUNCTIONS_SCHEMA = {"type": "object", "properties": {"functions": {"type": "array", "items": {
    "type": "object", "properties": {"function_name": {"type": "string"}, "description_of_behaviour": {"type": "string"},
                                     "number_of_parameters": {"type": "integer"}},
    "required": ["function_name", "description_of_behaviour", "number_of_parameters"]}}}, "required": ["functions"]}
EXTRA = {"json": {"response_format": {"type": "json_schema", "json_schema": {"name": "functions",
                                                                            "schema": FUNCTIONS_SCHEMA}}}}
DEFAULT_WORKLOADS = "edit,tool_args,chat"


def spec_counters(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    return {line.split(" ")[0][len("mlxd_engine_spec_"):]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("mlxd_engine_spec_")}


def one_request(url: str, messages: list[dict], max_tokens: int, extra: dict | None = None) -> dict[str, Any]:
    before = spec_counters(url)
    answer = stream_chat(url, messages, max_tokens, extra)
    started, first, text, usage = answer["started"], answer["first"], answer["text"], answer["usage"]
    end = time.perf_counter()
    after = spec_counters(url)
    tokens = usage.get("completion_tokens", 0)
    return {"ttft_s": (first or end) - started, "decode_s": end - (first or end), "tokens": tokens,
            "decode_tok_s": (tokens - 1) / (end - first) if first and tokens > 1 and end > first else None,
            "text": text, "spec": {k: after.get(k, 0) - before.get(k, 0) for k in after}}


def summarize(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """Per workload and arm: median decode tok/s, tokens per forward,
    acceptance, and against the `off` arm: the speedup and whether every
    answer was the same (pure)."""
    out: dict[str, dict[str, Any]] = {}
    for w in sorted({r["workload"] for r in runs}):
        out[w] = {}
        texts = {r["arm"]: r["text"] for r in runs if r["workload"] == w}
        for arm in ARMS:
            mine = [r for r in runs if r["workload"] == w and r["arm"] == arm]
            if not mine:
                continue
            rates = [r["decode_tok_s"] for r in mine if r["decode_tok_s"]]
            spec = {k: sum(r["spec"].get(k, 0) for r in mine) for k in ("proposed", "accepted", "forwards", "tokens")}
            out[w][arm] = {"decode_tok_s": statistics.median(rates) if rates else None,
                           "ttft_s": statistics.median(r["ttft_s"] for r in mine),
                           "tokens": statistics.median(r["tokens"] for r in mine),
                           "tokens_per_forward": spec["tokens"] / spec["forwards"] if spec["forwards"] else None,
                           "acceptance": spec["accepted"] / spec["proposed"] if spec["proposed"] else None,
                           "identical": all(r["text"] == texts.get("off") for r in mine)}
        off = out[w].get("off", {}).get("decode_tok_s")
        for arm in ARMS[1:]:
            if arm in out[w]:
                on = out[w][arm]["decode_tok_s"]
                out[w][arm]["speedup"] = on / off if on and off else None
        out[w]["identical"] = all(v["identical"] for v in out[w].values())
        out[w]["speedup"] = out[w].get("prompt_lookup", {}).get("speedup")
    return out


def table(summary: dict) -> str:
    lines = ["| workload | arm | decode tok/s | against off | tokens a forward | accepted | answers as off's |",
             "|---|---|---:|---:|---:|---:|---|"]
    fmt = lambda v, f="{:.1f}": "—" if v is None else f.format(v)  # noqa: E731
    for w, s in summary.items():
        for arm in ARMS:
            if arm not in s:
                continue
            a = s[arm]
            lines.append(f"| {w} | {arm} | {fmt(a['decode_tok_s'])} | {fmt(a.get('speedup'), '{:.2f}x')} | "
                         f"{fmt(a['tokens_per_forward'], '{:.2f}')} | {fmt(a['acceptance'], '{:.0%}')} | "
                         f"{'yes' if a['identical'] else 'NO'} |")
    return "\n".join(lines)


VERIFY_TOKENS = (1, 2, 3, 5, 9, 17)  # a plain step, then verifies of 1, 2, 4, 8, 16 proposed tokens


def verify_cost(model_path: Path | None, contexts: list[int], reps: int) -> dict[str, Any]:
    """Forward time of n tokens over a context, against one token's (in process)."""
    from mlxd.engine.cpu.fast_blas import activate

    activate()  # before MLX: OpenBLAS under MLX's CPU backend, as the engine has it
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlxd.engine.model.model_load import load_resident

    on_cpu = not (mx.metal.is_available() or mx.cuda.is_available())
    if model_path is None:
        from mlxd import default_model
        from mlxd.engine.model.gguf_convert import convert_gguf

        model_path = convert_gguf(default_model.gguf_path(), Path(tempfile.gettempdir()) / "mlxd-spec-gguf",
                                  say=lambda m: say(f"   {m}"))
    say(f"loading {model_path} ({'CPU, float32' if on_cpu else mx.default_device()})")
    model = load_resident("bench", str(model_path), "float32" if on_cpu else None).model
    rows = []
    for context in contexts:
        kv = make_prompt_cache(model)
        for at in range(0, context, 2048):  # the context, in prefill-sized steps
            mx.eval([c.state for c in kv] + [model(mx.array([[(7 * i) % 1000 + 10 for i in range(
                at, min(context, at + 2048))]]), cache=kv)[0, -1]])

        def forward_s(n: int) -> float:
            began = time.perf_counter()
            mx.eval(mx.argmax(model(mx.array([[(13 * i) % 1000 + 10 for i in range(n)]]), cache=kv)[0], axis=-1))
            took = time.perf_counter() - began
            trim_prompt_cache(kv, n)
            return took

        for n in VERIFY_TOKENS:  # warm-up: each shape's kernels compiled before any is timed
            forward_s(n), forward_s(n)
        times: dict[int, list[float]] = {n: [] for n in VERIFY_TOKENS}
        for _ in range(reps):  # the sizes interleaved, so drift falls on all of them alike
            for n in VERIFY_TOKENS:
                times[n].append(forward_s(n))
        step = statistics.median(times[1])
        for n in VERIFY_TOKENS:
            t = statistics.median(times[n])
            rows.append({"context": context, "tokens": n, "proposed": n - 1, "ms": t * 1000, "vs_step": t / step})
            say(f"context {context:6d}: {n:2d} tokens a forward {t * 1000:8.2f} ms = {t / step:.2f}x one step")
        del kv
    return {"model": str(model_path), "device": "cpu" if on_cpu else str(mx.default_device()), "rows": rows}


def verify_table(rows: list[dict]) -> str:
    contexts = sorted({r["context"] for r in rows})
    lines = ["| tokens a forward (proposed) | " + " | ".join(f"context {c}" for c in contexts) + " |",
             "|---|" + "---:|" * len(contexts)]
    for n in VERIFY_TOKENS:
        cells = [next((f"{r['ms']:.1f} ms ({r['vs_step']:.2f}x)" for r in rows
                       if r["context"] == c and r["tokens"] == n), "—") for c in contexts]
        lines.append(f"| {n} ({n - 1}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def concurrent_round(url: str, messages: list[dict], max_tokens: int, clients: int, extra: dict | None = None
                     ) -> dict[str, Any]:
    """`clients` copies of one request at once: their tokens over the wall time (the batch's aggregate)."""
    from concurrent.futures import ThreadPoolExecutor

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda _: one_request(url, messages, max_tokens, extra), range(clients)))
    wall = time.perf_counter() - began
    tokens = sum(r["tokens"] for r in results)
    return {"ttft_s": statistics.median(r["ttft_s"] for r in results), "tokens": tokens, "wall_s": wall,
            "decode_tok_s": tokens / wall, "text": results[0]["text"],
            "spec": {k: sum(r["spec"].get(k, 0) for r in results) / clients for k in results[0]["spec"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an mlx-lm model folder (default: mlxd's default model)")
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS, help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--draft", type=Path, help="a draft model folder of the model's tokenizer: a third arm")
    ap.add_argument("--draft-tokens", type=int, default=3, help="tokens the draft proposes per forward")
    ap.add_argument("--clients", type=int, default=1, help="requests at once an arm (max_concurrency the same)")
    ap.add_argument("--verify-cost", action="store_true", help="in process: k + 1 tokens a forward against one")
    ap.add_argument("--context", default="512,4096", help="--verify-cost: context lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=21, help="--verify-cost: forwards timed per size (median)")
    ap.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.max_tokens = 1, 64
    if args.verify_cost:
        result = verify_cost(args.model, [int(c) for c in args.context.split(",")], args.reps)
        md = verify_table(result["rows"])
        print(md)
        out = args.out.with_name("speculative_verify.json") if args.out == RESULTS / "speculative.json" else args.out
        write_json(out, {"benchmark": "speculative_verify", "machine": machine_info(), "settings": vars(args) | {
            "model": str(args.model or "default")}, **result, "table": md})
        say(f"results: {out}")
        return 0
    workloads = [w for w in args.workloads.split(",") if w]
    arms = ARMS if args.draft else ARMS[:2]
    work = Path(tempfile.mkdtemp(prefix="mlxd-spec-"))
    runs: list[dict] = []
    try:
        engines = {}
        for arm in arms:
            config: dict[str, Any] = {"engine": {"speculative": "prompt_lookup" if arm == "draft" else arm,
                                                 "stuck_grace_s": 600, "max_tokens_cap": 100000,
                                                 "max_concurrency": args.clients}}
            if args.model or arm == "draft":
                from mlxd import default_model

                target = {"path": args.model.resolve()} if args.model else {"gguf": str(default_model.gguf_path())}
                models: dict[str, Any] = {"bench": target}
                if arm == "draft":
                    models["bench"] = {**target, "draft": "bench-draft", "draft_tokens": args.draft_tokens}
                    models["bench-draft"] = {"path": args.draft.resolve()}
                config.update({"models": models, "aliases": {"default": "bench"}})
            say(f"starting the engine, speculative = {arm}")
            engines[arm] = start_engine(work / f"home-{arm}", config, work / f"engine-{arm}.log", name=arm)
            engines[arm].wait_ready(600)
        for arm, server in engines.items():  # warm-up: each workload once (a GPU compiles each verify's shapes)
            for w in workloads:
                one_request(server.url, WORKLOADS[w], min(128, args.max_tokens), EXTRA.get(w))
        for rnd in range(args.rounds):
            order = arms if rnd % 2 == 0 else arms[::-1]
            for w in workloads:
                for arm in order:
                    r = (one_request(engines[arm].url, WORKLOADS[w], args.max_tokens, EXTRA.get(w))
                         if args.clients == 1 else
                         concurrent_round(engines[arm].url, WORKLOADS[w], args.max_tokens, args.clients, EXTRA.get(w)))
                    r.update({"round": rnd, "workload": w, "arm": arm})
                    runs.append(r)
                    say(f"round {rnd + 1} {w:9s} {arm:13s} {r['tokens']:4d} tokens, decode "
                        f"{r['decode_tok_s'] or 0:6.1f} tok/s, TTFT {r['ttft_s']:.3f} s, spec {r['spec']}")
    finally:
        stop_all_children()
    summary = summarize(runs)
    md = table(summary)
    print(md)
    write_json(args.out, {"benchmark": "speculative", "machine": machine_info(), "settings": vars(args) | {
        "model": str(args.model or "default")}, "runs": runs, "summary": summary, "table": md})
    say(f"results: {args.out}")
    return 0 if all(s["identical"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
