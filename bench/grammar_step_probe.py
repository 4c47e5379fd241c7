#!/usr/bin/env python3
"""Where a bound answer's decode step goes (a diagnosis, not a benchmark):
mlx-lm's generate_step on one model in process, greedy, with logits
processors that add one piece at a time of what the grammar processor does:

  none         no processor (mlx-lm skips its token bookkeeping)
  identity     a processor that returns the logits (mlx-lm concatenates the tokens each step)
  read         identity + reading the last token on the host (.item(): a sync)
  read-early   read, after starting this step's forward pass (what engine/model/constrained.py does)
  mask         a constant mask applied with mx.where (no sync)
  sampler-tap  read-early, the last token taken from a wrapped sampler (scheduled before the forward pass)
               instead of the end of the growing token list (scheduled after it)
  grammar      engine/model/constrained.py's GrammarProcessor on a JSON-string grammar, as the engine runs it

Arms alternate over rounds; tok/s per arm (median). Usage:
  python bench/grammar_step_probe.py MODEL_DIR [--tokens 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from mlxd.engine.model.constrained import GrammarProcessor, grammar_tokenizer
    from mlxd.engine.model.grammar import OutputRules, answer_grammar

    model, tok = load(str(a.model))
    vocab = int(getattr(model.args, "vocab_size", 0) or len(tok.vocab))
    lt = grammar_tokenizer(tok, vocab)
    grammar = answer_grammar(OutputRules(schema={"type": "object", "properties": {"story": {"type": "string"}},
                                                 "required": ["story"]}), None)
    prompt = mx.array(tok.encode("Write a long story about a lighthouse keeper.")[-32:])
    constant = mx.array(np.ones(vocab, dtype=bool))
    neg = mx.array(-float("inf"))

    def identity(tokens, logits):
        return logits

    def read(tokens, logits):
        int(tokens[-1].item())
        return logits

    def read_early(tokens, logits):
        mx.async_eval(logits)
        int(tokens[-1].item())
        return logits

    def mask(tokens, logits):
        return mx.where(constant, logits, neg.astype(logits.dtype))

    class Tap:
        def __init__(self):
            self.last = None
            self.inner = make_sampler(0.0)

        def sample(self, logprobs):
            self.last = self.inner(logprobs)
            return self.last

        def __call__(self, tokens, logits):
            if self.last is not None:
                mx.async_eval(logits)
                int(self.last.item())
            return logits

    def arm(name: str):
        sampler = make_sampler(0.0)
        if name == "none":
            return sampler, None
        if name == "sampler-tap":
            tap = Tap()
            return tap.sample, [tap]
        if name == "grammar":
            proc = GrammarProcessor(lt, grammar, vocab, sorted(tok.eos_token_ids))
            return proc.sampling(sampler), [proc]
        return sampler, [{"identity": identity, "read": read, "read-early": read_early, "mask": mask}[name]]

    names = ["none", "identity", "read", "read-early", "mask", "sampler-tap", "grammar"]
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(a.rounds + 1):  # round 0 warms up every arm
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            sampler, processors = arm(name)
            steps = generate_step(prompt, model, max_tokens=a.tokens, sampler=sampler, logits_processors=processors)
            first = None
            n = 0
            for n, (token, _) in enumerate(steps, 1):
                if n == 2:
                    first = time.perf_counter()
            rate = (n - 2) / (time.perf_counter() - first)
            if r:
                rates[name].append(rate)
        if r:
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), file=sys.stderr, flush=True)
    base = statistics.median(rates["none"])
    print("| arm | tok/s | vs none |\n|---|---:|---:|")
    for name in names:
        m = statistics.median(rates[name])
        print(f"| {name} | {m:.1f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
