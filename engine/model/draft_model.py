"""Speculative decoding by a draft model (exact), the draft's side.

A smaller model of the same tokenizer (`[models.ID] draft`) proposes the
next `draft_tokens` tokens of a row and the resident model verifies them in
the batch's step (engine/model/row_proposals.py's DraftProposer,
engine/model/row_batch.py's verify): its tokens are the resident model's own
(greedy: the same tokens; sampled: the speculative acceptance rule). What is
here:
- `same_vocabulary`: the draft is refused at load unless its tokenizer maps
  every token to the same id (pure);
- `DraftModel`, the draft beside the resident model, and its KV: one
  allowance in the model's memory estimate (mlxd.models' with_draft), so one
  row holds it at a time (`take`, `put_back`); it keeps the KV of the last
  request it drafted for, so an agent's next turn prefills the draft only
  past what the two prompts share (the prompt cache holds the resident
  model's KV, not the draft's).
The draft is loaded and unloaded with the model (engine/model/runner.py).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

log = logging.getLogger("mlxd.engine.model.draft_model")

PREFILL_STEP = 512  # the draft's prompt, in steps of this many tokens (it is small: no pacing of its own)


def same_vocabulary(model_vocab: Mapping[str, int], draft_vocab: Mapping[str, int]) -> str | None:
    """Why a draft cannot propose tokens for a model (None: it can): every
    token must have the same id in both (a proposed id means the same text)."""
    if model_vocab == draft_vocab:
        return None
    differing = sorted(t for t in set(model_vocab) | set(draft_vocab) if model_vocab.get(t) != draft_vocab.get(t))
    return (f"its tokenizer differs ({len(model_vocab)} tokens against the draft's {len(draft_vocab)}; "
            f"{len(differing)} differ, e.g. {differing[:3]})")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share (pure)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModel:
    """The draft model beside the resident one, with its KV of the last request."""

    def __init__(self, model_id: str, model: Any) -> None:
        self.model_id = model_id
        self.model = model
        self._kv: list[Any] | None = None
        self._tokens: list[int] = []  # the tokens whose KV `_kv` holds
        self.taken = False  # a row holds the KV: the others decode without a draft

    def take(self, context: Sequence[int]) -> list[Any] | None:
        """The draft's KV holding `context` (a request's prompt but its last
        token) for a row: what it shares with the last request's is kept,
        the rest prefilled; None while another row holds it."""
        if self.taken:
            return None
        kept = common_prefix(self._tokens, context) if self._kv is not None else 0
        if kept == 0 or self._kv is None:
            self._kv = make_prompt_cache(self.model)
        elif len(self._tokens) > kept:
            trim_prompt_cache(self._kv, len(self._tokens) - kept)
        for at in range(kept, len(context), PREFILL_STEP):
            self.model(mx.array([list(context[at:at + PREFILL_STEP])], dtype=mx.int32), cache=self._kv)
            mx.eval([c.state for c in self._kv])
        self._tokens = list(context)
        self.taken = True
        return self._kv

    def put_back(self, kv: list[Any], tokens: Sequence[int]) -> None:
        """A row ended: its draft KV, holding `tokens`, kept for the next request's common prefix."""
        from ..cache.prompt_cache import kv_offset

        self.taken = False
        held = kv_offset(kv) if kv else None
        if held != len(tokens):  # not a plain KV cache, or not what it should hold: start over
            self._kv, self._tokens = None, []
        else:
            self._kv, self._tokens = kv, list(tokens)

    def close(self) -> None:
        self._kv, self._tokens, self.taken = None, [], False
