"""Constrained decoding: a grammar (engine/model/grammar.py) applied token by
token, as a logits processor of a row of the batch (engine/model/row_batch.py:
a lone request's as a batch's), and in a verify step driven token by token
(`catch_up`, `masks_along`, `took`).

The batch calls a processor with the tokens so far (ending in the token just
fed to the model) and that step's logits. The first call of an answer ends
in the prompt's last token; every later call ends in the token sampled at
the step before, which the matcher consumes before it masks the next one.
Tokens the grammar does not allow get -inf; once the grammar is complete
only end-of-sequence tokens remain, so the answer ends there.

Runs on the worker thread (MLX). The llguidance tokenizer is built once per
resident model, not per request: building it is not free
(docs/BENCHMARKS.md, "Why the engine is built as it is").
"""

from __future__ import annotations

import json
import logging
from typing import Any

import mlx.core as mx

log = logging.getLogger("mlxd.engine.core.worker")


def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the model's tokenizer, sized to its logits."""
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids))


def marker_literal(ll_tokenizer: Any, hf_tokenizer: Any):
    """A function writing a marker as a Lark literal: a special token by its
    id (text never matches one), anything else as quoted text."""
    def literal(text: str) -> str:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ll_tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)
    return literal


_EXECUTOR: Any = None  # llguidance's thread pool: the rows' masks computed in parallel (the worker's only)


def step_masks(grammars: list["GrammarProcessor"], width: int) -> mx.array:
    """The tokens each grammar allows next, one row each (rows x `width`
    bools, lazily on the device): the masks filled in parallel by llguidance
    into one packed array, unpacked by a few ops for all rows at once (one
    row's mask alone, 128k entries made and copied on the host, cost a
    bound batch ~14 % of its tokens on the lent H100). A grammar complete (or
    failed) allows end-of-sequence only."""
    import llguidance
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask_par, get_bitmask_shape

    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    vocab = grammars[0].vocab_size
    packed = np.zeros(get_bitmask_shape(len(grammars), vocab), dtype=np.int32)
    live = []
    for i, g in enumerate(grammars):
        if g.failed or g.matcher.is_stopped():
            for t in g.eos_ids:
                packed[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        else:
            live.append((g.matcher, i))
    if live:
        fill_next_token_bitmask_par(_EXECUTOR, live, packed)
    ids = mx.arange(width, dtype=mx.uint32)
    words = mx.take(mx.array(packed).view(mx.uint32), mx.minimum(ids >> 5, packed.shape[1] - 1), axis=1)
    return (((words >> (ids & 31)) & 1) == 1) & (ids < vocab)


class GrammarProcessor:
    """The logits processor for one answer's grammar."""

    def __init__(self, ll_tokenizer: Any, grammar: str, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._fresh = True  # the next call ends in a token already consumed (or in the prompt)
        self._sampled: Any = None  # the token the row's sampler drew last (a 1-element array)
        self.failed = False

    def sampling(self, sampler: Any) -> Any:
        """The row's sampler, tapped: the processor reads the token it drew
        from there (an array scheduled before the next forward pass), not from
        the end of the token list mlx-lm passes (scheduled after it)."""
        def tapped(logprobs: Any) -> Any:
            self._sampled = sampler(logprobs)
            return self._sampled
        return tapped

    # --- driven by the batch's step (engine/model/row_batch.py), not through __call__ ------------------------------
    def catch_up(self, last: int) -> None:
        """A verify step begins with `last`, the row's newest token, which
        __call__ would consume first: consumed here (none at the answer's start)."""
        if self._fresh:
            self._fresh = False
        else:
            self.advance(last)

    def took(self, kept: list[int]) -> None:
        """A verify step kept `kept` (consumed here); the token it drew after
        them is the row's next input, which the next step's `catch_up` takes."""
        for token in kept:
            self.advance(token)

    def allowed(self) -> Any:
        """The tokens the grammar allows next (a bool per vocabulary entry):
        end-of-sequence only once it is complete (or failed)."""
        import numpy as np

        if self.failed or self.matcher.is_stopped():
            allowed = np.zeros(self.vocab_size, dtype=bool)
            allowed[self.eos_ids] = True
            return allowed
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)

    def advance(self, token: int) -> None:
        """`token` was chosen (under the mask `allowed` gave): the matcher takes it."""
        if not self.matcher.is_stopped() and not self.matcher.consume_token(token) and not self.failed:
            self.failed = True
            log.warning("grammar: token %d was not allowed (%s); ending the answer", token, self.matcher.get_error())

    def forced(self, k: int) -> list[int]:
        """Up to `k` tokens the grammar allows alone from here (a JSON key, a
        closing quote): proposals the model cannot turn down."""
        if self.failed or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:k]

    def masks_along(self, proposal: list[int]) -> tuple[list[int], list[Any]]:
        """The longest prefix of `proposal` the grammar allows, and the mask
        before each of its tokens and after the last (len + 1 masks); the
        matcher is left where it was."""
        masks, kept = [self.allowed()], []
        for token in proposal:
            if not masks[-1][token] or self.matcher.is_stopped() or not self.matcher.consume_token(token):
                break
            kept.append(token)
            masks.append(self.allowed())
        if kept:
            self.matcher.rollback(len(kept))
        return kept, masks

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import numpy as np

        if self._fresh:
            self._fresh = False
        elif not self.matcher.is_stopped():
            if self._sampled is not None:
                # Start this step's forward pass, then wait for the token drawn before it: the device
                # computes while the mask is made here. (Read from the end of mlx-lm's token list, the
                # token waits for the forward pass too, being scheduled after it, and bound decoding is
                # much slower: docs/BENCHMARKS.md, "Why the engine is built as it is".)
                mx.async_eval(logits)
                token = int(self._sampled.item())
            else:
                token = int(tokens[-1].item())
            if not self.matcher.consume_token(token) and not self.failed:
                # Cannot happen while the mask is applied last; if it does, end the answer rather than go on unbound.
                self.failed = True
                log.warning("grammar: token %d was not allowed (%s); ending the answer", token,
                            self.matcher.get_error())
        if self.failed or self.matcher.is_stopped():
            allowed = np.zeros(self.vocab_size, dtype=bool)
            allowed[self.eos_ids] = True
        else:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        width = logits.shape[-1]
        if width != self.vocab_size:  # logits wider than the vocabulary: the padding is never allowed
            allowed = np.pad(allowed, (0, max(width - self.vocab_size, 0)))[:width]
        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))
