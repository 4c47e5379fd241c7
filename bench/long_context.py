#!/usr/bin/env python3
"""What serving the default model past its trained context costs in quality
(issue 50): SmolLM2-135M was trained on 8,192 tokens; mlxd serves it with
32,768 by YaRN RoPE scaling (`extend_context`, engine/model/model_load.py).

Each arm reads one window of natural text (Python's own reference manual,
`pydoc_data.topics`, which every Python ships) ending at the same token and
is scored on the same last `--tail` tokens of it (perplexity: lower is
better), then answers a pass-key question about a sentence at the window's
start (greedy). The arms:

  plain-8k       the model as trained, the last 8,000 tokens (the reference)
  yarn-<N>       mlxd's extension (YaRN without its attention temperature), N tokens
  yarn-temp-<N>  YaRN with the paper's temperature (mscale 0.1 ln s + 1), N tokens
  plain-<N>      unscaled, N tokens (what serving it past its context without scaling reads)

In process, loaded as the engine loads it on this CPU (dequantised, float32,
OpenBLAS where set-up built it). Progress to stderr, a Markdown table to
stdout, JSON to --out.

`--served` measures what a user sees instead: a real `mlxd engine` with no
model configured (the default model as served, 32k by YaRN), an agent-sized
prompt (the pass-key sentence, then ~`--context` tokens of the manual as its
system prompt, then the question) streamed: turn 1's TTFT (the whole
prefill), then turn 2 (the answer and a new question appended: all but its
last tokens from the prompt cache) and whether each answer names the key.
The engine's request deadline is raised to an hour for it (a CPU's 20k-token
prefill outlasts the default 10 minutes).

  .venv/bin/python bench/long_context.py                       # 20,000 tokens, all four arms (CPU: hours)
  .venv/bin/python bench/long_context.py --arms plain-8k,yarn --context 12000
  .venv/bin/python bench/long_context.py --served              # the engine's TTFT, turn 1 and the cached turn 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import RESULTS, machine_info, md_table, say, write_json  # noqa: E402

PASSKEY = "71432"
KEY_SENTENCE = f"Remember this: the pass key is {PASSKEY}. "
QUESTION = "\n\nWhat is the pass key mentioned at the start? The pass key is"
TRAINED = 8192


def arm_config(arm: str, context: int) -> tuple[dict, int]:
    """(mlx-lm config overrides, window tokens) of an arm (pure)."""
    from mlxd.engine.model.model_load import context_extension

    if arm == "plain-8k":
        return {}, 8000
    if arm == "plain":
        return {"max_position_embeddings": max(context, TRAINED)}, context
    extended = context_extension({"max_position_embeddings": TRAINED}, 32768)
    if arm == "yarn-temp":
        rope = {k: v for k, v in extended["rope_scaling"].items() if k not in ("mscale", "mscale_all_dim")}
        extended = {**extended, "rope_scaling": rope}
    return extended, context


def run_arm(folder: Path, tok_ids: list[int], arm: str, context: int, tail: int, chunk: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import dequantize_model, load

    overrides, window = arm_config(arm, context)
    model, tokenizer = load(str(folder), model_config=overrides)
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    key = tokenizer.encode(KEY_SENTENCE, add_special_tokens=False)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    body = tok_ids[len(tok_ids) - (window - len(key) - len(question)):]
    seq = key + body + question
    scored_from = len(key) + len(body) - tail  # the tail: the body's last `tail` tokens, the same in every arm
    cache = make_prompt_cache(model)
    nll, pos, started, logits = 0.0, 0, time.monotonic(), None
    while pos < len(seq):
        part = seq[pos:pos + chunk]
        logits = model(mx.array(part)[None], cache=cache)[0]
        rows = [i for i in range(pos, pos + len(part)) if scored_from - 1 <= i < scored_from + tail - 1]
        if rows:
            lp = logits[mx.array([i - pos for i in rows])].astype(mx.float32)
            lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
            targets = mx.array([seq[i + 1] for i in rows])[:, None]
            nll -= mx.take_along_axis(lp, targets, axis=-1).sum().item()
        mx.eval([c.state for c in cache])
        pos += len(part)
        say(f"  {arm}: {pos}/{len(seq)} tokens ({time.monotonic() - started:.0f}s)")
    prefill_s = time.monotonic() - started
    answer = []
    token = int(mx.argmax(logits[-1]).item())
    for _ in range(8):
        answer.append(token)
        token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]).item())
    text = tokenizer.decode(answer)
    return {"arm": arm, "window_tokens": len(seq), "tail_tokens": tail, "perplexity": round(math.exp(nll / tail), 3),
            "pass_key_found": PASSKEY in text, "answer": text.strip(), "prefill_s": round(prefill_s, 1),
            "prefill_tok_s": round(len(seq) / prefill_s, 1)}


def served(context: int, out: Path) -> None:
    """Turn 1 and the cached turn 2 of an agent-sized prompt on a real engine
    serving the default model as configured by default."""
    import tempfile

    import pydoc_data.topics as topics

    from benchkit import start_engine, stream_chat

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    system = KEY_SENTENCE + "You are a coding agent. Reference manual follows.\n\n" + text[:context * 4]
    home = Path(tempfile.mkdtemp(prefix="long-context-served-"))
    engine = start_engine(home, {"engine": {"max_prompt_tokens": 32768, "request_deadline_s": 3600,
                                            "stuck_grace_s": 3600}}, home / "engine.log")
    rows = []
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the pass key?"}]
    for turn in (1, 2):
        say(f"turn {turn}: streaming ({len(system)} characters of system prompt)")
        got = stream_chat(engine.url, messages, 24, timeout=7200)
        usage = got["usage"]
        rows.append({"turn": turn, "prompt_tokens": usage.get("prompt_tokens"),
                     "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                     "ttft_s": round((got["first"] or got["end"]) - got["started"], 2), "answer": got["text"].strip(),
                     "pass_key_found": PASSKEY in got["text"]})
        say(f"  {json.dumps(rows[-1])}")
        messages += [{"role": "assistant", "content": got["text"]}, {"role": "user", "content": "Say it again."}]
    write_json(out, {"machine": machine_info(), "context_chars": len(system), "rows": rows})
    print(md_table(["turn", "prompt tokens", "cached", "TTFT s", "pass key", "answer"],
                   [[str(r[k]) for k in ("turn", "prompt_tokens", "cached_tokens", "ttft_s", "pass_key_found",
                                         "answer")] for r in rows]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, help="the default model's GGUF (default: where set-up put it)")
    p.add_argument("--context", type=int, default=20000)
    p.add_argument("--tail", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--arms", default="plain-8k,yarn,yarn-temp,plain")
    p.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    p.add_argument("--served", action="store_true", help="a real engine's turn 1 and cached turn 2 instead")
    args = p.parse_args()
    if args.served:
        served(args.context, args.out)
        return

    from mlxd import default_model
    from mlxd.engine.cpu import fast_blas

    fast_blas.activate()  # before MLX is imported: OpenBLAS under its CPU backend, as in the engine
    import tempfile

    import pydoc_data.topics as topics

    from mlxd.engine.model.gguf_convert import convert_gguf

    gguf = args.gguf or default_model.gguf_path()
    folder = convert_gguf(gguf, Path(tempfile.mkdtemp(prefix="long-context-")), say)
    from mlx_lm.utils import load_tokenizer

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = load_tokenizer(folder).encode(text, add_special_tokens=False)[:args.context + 4096]
    say(f"{len(ids)} tokens of text; window {args.context}, tail {args.tail}")
    rows = []
    for arm in args.arms.split(","):
        rows.append(run_arm(folder, ids[:args.context], arm, args.context, args.tail, args.chunk))
        say(f"  {json.dumps(rows[-1])}")
    reference = next((r["perplexity"] for r in rows if r["arm"] == "plain-8k"), None)
    for r in rows:
        r["vs_plain_8k"] = round(r["perplexity"] / reference, 3) if reference else None
    write_json(args.out, {"machine": machine_info(), "context": args.context, "rows": rows})
    print(md_table(["arm", "window", "perplexity (tail)", "vs plain-8k", "pass key", "prefill s", "tok/s"],
                   [[str(v) for v in (r["arm"], r["window_tokens"], r["perplexity"], r["vs_plain_8k"],
                                      r["pass_key_found"], r["prefill_s"], r["prefill_tok_s"])] for r in rows]))


if __name__ == "__main__":
    main()
