"""Speculative decoding by a draft model, for the one-row decoder (exact).

A smaller model of the same tokenizer (`[models.ID] draft`) proposes the
next `draft_tokens` tokens and the resident model verifies them in one
forward: mlx-lm's `speculative_generate_step` does both, and its tokens are
the resident model's own (greedy: the same tokens; sampled: each token is the
resident model's draw, the draft deciding only how many come from one
forward). What is ours:
- `same_vocabulary`: the draft is refused at load unless its tokenizer maps
  every token to the same id (pure);
- `DraftModel` keeps the draft's KV of the last request it decoded, so an
  agent's next turn prefills the draft only past what the two prompts share
  (the prompt cache holds the resident model's KV, not the draft's);
- `draft_steps` counts what was proposed and accepted for the log and
  /metrics (SpecStats), as prompt lookup does.
The draft's weights and KV are in the model's memory estimate (mlxd.models'
with_draft) and so in the engine's ledger; it is loaded and unloaded with
the model (engine/model/runner.py).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping, Sequence

import mlx.core as mx
from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .speculative import SpecStats

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

    def kv_for(self, context: Sequence[int]) -> list[Any]:
        """The draft's KV holding `context` (a request's prompt but its last
        token): what it shares with the last request's is kept, the rest
        prefilled."""
        kept = common_prefix(self._tokens, context) if self._kv is not None else 0
        if kept == 0 or self._kv is None:
            self._kv = make_prompt_cache(self.model)
        elif len(self._tokens) > kept:
            trim_prompt_cache(self._kv, len(self._tokens) - kept)
        for at in range(kept, len(context), PREFILL_STEP):
            self.model(mx.array([list(context[at:at + PREFILL_STEP])], dtype=mx.int32), cache=self._kv)
            mx.eval([c.state for c in self._kv])
        self._tokens = list(context)
        return self._kv

    def ended(self, sequence: Sequence[int]) -> None:
        """A request ended: its KV holds the first `offset` of `sequence` (its
        prompt and answer), kept for the next request's common prefix."""
        from ..cache.prompt_cache import kv_offset

        held = kv_offset(self._kv) if self._kv else None
        if held is None or held > len(sequence):  # not a plain KV cache, or not what it should hold: start over
            self._kv, self._tokens = None, []
        else:
            self._tokens = list(sequence[:held])

    def close(self) -> None:
        self._kv, self._tokens = None, []


def draft_steps(model: Any, kv: list[Any], draft: DraftModel, rest: list[int], context: Sequence[int],
                max_tokens: int, sampler: Any, draft_tokens: int, stats: SpecStats) -> Iterator[tuple[int, None]]:
    """The resident model's tokens ((token, None), as generate_step yields
    them) from mlx-lm's speculative_generate_step with the draft's
    proposals; `kv` holds `context`, `rest` is the prompt's last token."""
    draft_kv = draft.kv_for(context)
    steps = speculative_generate_step(mx.array(rest, dtype=mx.int32), model, draft.model,
                                      num_draft_tokens=draft_tokens, max_tokens=max_tokens, sampler=sampler,
                                      prompt_cache=list(kv) + list(draft_kv))
    produced, cycle_start = 0, 0
    try:
        for token, _, from_draft in steps:
            produced += 1
            stats.tokens += 1
            if from_draft:
                stats.accepted += 1
            else:  # a verify's own token ends it: it had proposed up to draft_tokens (fewer near max_tokens)
                stats.forwards += 1
                stats.proposed += min(draft_tokens, max_tokens - cycle_start)
                cycle_start = produced
            yield int(token), None
    finally:
        if produced > cycle_start:  # it ended inside a verify's accepted tokens (its length, a stop)
            stats.forwards += 1
            stats.proposed += min(draft_tokens, max_tokens - cycle_start)
        steps.close()  # mlx-lm's own clean-up: the rejected positions cut back from both caches
