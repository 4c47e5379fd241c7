"""The batch's decode loop, mlxd's own: rows of any length, each with its
own cache, a token a row each step (engine/model/row_attention.py: the
matrix products together, attention row by row without a mask).

It takes what mlx-lm's BatchGenerator takes from engine/model/many_rows.py
-- a row joins with the token it decodes next, its cache, its sampler and
logits processors -- and answers as it does: each step, the token each row
decoded, with the row's cache once it ended (an end-of-sequence token or its
max_tokens). Nothing is merged or copied when a row joins or leaves: a row's
cache stays the one admission allocated for it (engine/cache/kv_cache.py).

One step ahead, as mlx-lm's generators run: a step builds the next step's
forward on the tokens it sampled, lazily, and starts it before it reads
those tokens, so the device works while the host relays them. A row that
ends has had one more token computed than it takes: that token is dropped
(its KV holds everything up to the last token it answered).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import TokenBuffer

from .row_attention import positions, row_caches


@dataclass(eq=False)
class _Row:
    uid: int
    kv: list[Any]
    next_input: mx.array  # [1]: what the next step runs through the model (lazy once sampled)
    max_tokens: int
    sampler: Any  # None: greedy
    processors: list[Any]
    context: TokenBuffer | None  # the tokens its KV holds, for its processors (penalties, a grammar)
    answered: int = 0
    joining: bool = True  # its first input is its prompt's last token, not a token it answered


@dataclass(frozen=True)
class RowToken:
    """A token a row decoded in a step; its cache when the row ended with it."""

    uid: int
    token: int
    finish_reason: str | None
    prompt_cache: list[Any] | None = None


@dataclass
class RowBatch:
    model: Any
    stop_tokens: frozenset[int]
    rows: list[_Row] = field(default_factory=list)
    _next_uid: int = 0

    def insert(self, token: int, kv: list[Any], max_tokens: int, context: list[int], sampler: Any,
               processors: list[Any]) -> int:
        """A row joins with the token it runs next (its prompt's last); `context`: the tokens its KV holds."""
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        self.rows.append(_Row(uid, kv, mx.array([token], dtype=mx.int32), max_tokens, sampler, list(processors),
                              TokenBuffer(list(context)) if processors else None))
        return uid

    def remove(self, uid: int) -> list[Any] | None:
        """A row out of the batch (ended by its request: a stop string, a
        cancel), with its cache; the token computed for it ahead is dropped."""
        row = next((r for r in self.rows if r.uid == uid), None)
        if row is None:
            return None
        self.rows.remove(row)
        return row.kv

    def close(self) -> None:
        self.rows = []

    def next(self) -> list[RowToken]:
        """One step: the next token of every row (none for a row that has just joined)."""
        rows = list(self.rows)
        if not rows:
            return []
        inputs = rows[0].next_input if len(rows) == 1 else mx.concatenate([r.next_input for r in rows])
        with mx.stream(generation_stream):
            sampled, contexts = self._forward(rows, inputs)
        for i, r in enumerate(rows):
            r.next_input = sampled[i:i + 1]
        mx.async_eval(sampled, *contexts)  # the next step's tokens computed while these are relayed
        return self._answer(rows, inputs.tolist())

    def _forward(self, rows: list[_Row], inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """The model over every row's input, each row's processors and sampler: the tokens sampled."""
        kv = [r.kv for r in rows]
        logits = self.model(inputs[:, None], cache=row_caches(kv, positions(kv)))[:, -1, :]
        contexts = []
        if any(r.processors for r in rows):
            processed = []
            for i, r in enumerate(rows):
                row_logits = logits[i:i + 1]
                if r.processors:
                    context = r.context.update_and_fetch(inputs[i:i + 1])
                    contexts.append(context)
                    for processor in r.processors:
                        row_logits = processor(context, row_logits)
                processed.append(row_logits)
            logits = mx.concatenate(processed, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [r.sampler for r in rows]
        if all(s is samplers[0] for s in samplers):  # one call for rows that share a sampler (greedy too)
            sampled = logprobs.argmax(axis=-1) if samplers[0] is None else samplers[0](logprobs)
        else:
            sampled = mx.concatenate([(lp.argmax(axis=-1) if s is None else s(lp))
                                      for lp, s in ((logprobs[i:i + 1], s) for i, s in enumerate(samplers))])
        return sampled.astype(mx.int32), contexts

    def _answer(self, rows: list[_Row], tokens: list[int]) -> list[RowToken]:
        """Each row's token of this step; rows that ended leave with their cache."""
        out = []
        for r, token in zip(rows, tokens):
            if r.joining:  # its prompt's last token: what it answers comes from the next step on
                r.joining = False
                continue
            r.answered += 1
            finish = "stop" if token in self.stop_tokens else "length" if r.answered >= r.max_tokens else None
            if finish is not None:
                self.rows.remove(r)
            out.append(RowToken(r.uid, token, finish, r.kv if finish is not None else None))
        return out
