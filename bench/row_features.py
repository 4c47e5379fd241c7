#!/usr/bin/env python3
"""What a row's features cost in the batch's step (issue 51: "prompt lookup and
grammar inside the batch at 4 rows cost <= 5 % against plain rows when they
propose nothing"), in process, no server: mlxd's RowBatch
(engine/model/row_batch.py) decoding --rows rows of --context tokens each, every
arm the same rows and prompts, arms alternated in rounds:

  plain     no proposer, no processor (greedy)
  lookup    each row a prompt-lookup proposer (engine/model/row_proposals.py)
  grammar   each row a grammar (a free-text Lark grammar through llguidance: every token allowed but EOS
            past the limit, so the tokens are plain decoding's and only the machinery costs)
  both      a grammar and prompt lookup

The prompts are random tokens (nothing to copy: a proposer mostly proposes
nothing), unless --copying, where each prompt is one random span repeated
(copying pays). Reported: tokens a second of every arm (median of --rounds)
and its ratio to plain, tokens a forward, and each arm's answers checked
equal to those of its arm without prompt lookup (greedy: the same tokens,
prompt lookup exact; a grammar's mask keeps tokens that are no text, such as
special tokens, out of its arms' answers, so theirs are compared apart).

  python bench/row_features.py --model /path/to/mlx/model --rows 4 --context 2048 --tokens 256
  python bench/row_features.py           # the demo model a, CPU-sized
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import demo_model, machine_info, say, write_json  # noqa: E402

ARMS = ("plain", "lookup", "grammar", "both")
FREE_TEXT = 'start: /(.|\\n)*/'


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--copying", action="store_true", help="prompts that repeat a span: prompt lookup pays")
    p.add_argument("--out", type=Path, default=Path("bench/results/row_features.json"))
    args = p.parse_args(argv)

    from mlxd.engine.cpu import fast_blas

    fast_blas.activate()
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxd.engine.cache.kv_cache import make_kv
    from mlxd.engine.model.constrained import GrammarProcessor, grammar_tokenizer
    from mlxd.engine.model.model_load import load_resident
    from mlxd.engine.model.row_attention import route_attention, rows_decode_exact
    from mlxd.engine.model.row_batch import RowBatch
    from mlxd.engine.model.row_proposals import LookupProposer
    from mlxd.memory_estimate import KVLayout

    model_path = args.model or demo_model("a")[1]
    on_cpu = mx.default_device() == mx.cpu
    resident = load_resident("bench", str(model_path), "float32" if on_cpu else None)
    model, tok = resident.model, resident.tokenizer
    route_attention()
    apart, verify_together = rows_decode_exact(model)
    vocab = resident.vocab_size()
    ll_tok = grammar_tokenizer(tok, vocab)
    eos = sorted(tok.eos_token_ids)
    rng = random.Random(7)
    prompts = []
    for _ in range(args.rows):
        if args.copying:
            span = [rng.randrange(100, min(vocab, 30000)) for _ in range(64)]
            prompts.append((span * (args.context // 64 + 1))[:args.context])
        else:
            prompts.append([rng.randrange(100, min(vocab, 30000)) for _ in range(args.context)])
    arms = args.arms.split(",")
    say(f"{model_path.name}: {args.rows} rows of {args.context} tokens, {args.tokens} tokens each; arms {arms}; "
        f"rows apart {apart}, verify together {verify_together}")

    def run(arm: str) -> tuple[float, int, list[list[int]]]:
        batch = RowBatch(model, frozenset(eos), apart=apart, verify_together=verify_together)
        uids = []
        for prompt in prompts:
            kv = make_kv(model, len(prompt) + args.tokens + 16, KVLayout())
            model(mx.array([prompt[:-1]]), cache=kv)
            mx.eval([c.state for c in kv])
            grammar = (GrammarProcessor(ll_tok, FREE_TEXT, vocab, eos) if arm in ("grammar", "both") else None)
            sampler = grammar.sampling(make_sampler(0.0)) if grammar is not None else None
            proposer = LookupProposer(list(prompt), grammar) if arm in ("lookup", "both") else None
            uids.append(batch.insert(prompt[-1], kv, args.tokens, prompt[:-1], sampler,
                                     [grammar] if grammar is not None else [], None, proposer, grammar))
        out: dict[int, list[int]] = {u: [] for u in uids}
        forwards = 0
        began = time.perf_counter()
        while batch.rows:
            for t in batch.next():
                out[t.uid].append(t.token)
            forwards += 1
        mx.eval(mx.array(0))
        return time.perf_counter() - began, forwards, [out[u] for u in uids]

    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    run(arms[0])  # shapes and kernels seen once
    for r in range(args.rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            seconds, forwards, answers = run(arm)
            tokens = sum(len(a) for a in answers)
            results[arm].append({"seconds": seconds, "forwards": forwards, "tokens": tokens, "answers": answers})
            say(f"  round {r + 1} {arm}: {tokens / seconds:.1f} tok/s, {tokens / forwards:.2f} tokens a step")
    plain_tps = statistics.median(x["tokens"] / x["seconds"] for x in results["plain"]) if "plain" in results else None
    base = {"plain": "plain", "lookup": "plain", "grammar": "grammar", "both": "grammar"}
    print(f"### Row features in the batch ({model_path.name}, {args.rows} rows x {args.context} tokens, "
          f"{args.tokens} generated, {'copying' if args.copying else 'random'} prompts)\n")
    print("| arm | tok/s (median) | × plain | tokens a step | answers as without lookup |")
    print("|---|---:|---:|---:|:---:|")
    summary = {}
    for arm in arms:
        tps = statistics.median(x["tokens"] / x["seconds"] for x in results[arm])
        per_step = statistics.median(x["tokens"] / x["forwards"] for x in results[arm])
        reference = results[base[arm]][0]["answers"] if base[arm] in results else None
        same = reference is None or all(x["answers"] == reference for x in results[arm])
        ratio = tps / plain_tps if plain_tps else None
        summary[arm] = {"tokens_per_s": tps, "ratio_to_plain": ratio, "tokens_per_step": per_step, "same": same}
        print(f"| {arm} | {tps:.1f} | {ratio:.3f} | {per_step:.2f} | {'yes' if same else '**no**'} |")
    for arm in results:
        for x in results[arm]:
            del x["answers"]
    write_json(args.out, {"machine": machine_info(), "settings": {k: str(v) for k, v in vars(args).items()},
                          "summary": summary, "runs": results})
    return 0 if all(s["same"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
