"""The batch's decode loop, mlxd's own: rows of any length, each with its
own cache, a token a row each step (engine/model/row_attention.py: the
matrix products together, attention row by row without a mask).

It takes what mlx-lm's BatchGenerator takes from engine/model/many_rows.py
-- a row joins with the token it decodes next, its cache, its sampler and
logits processors -- and answers as it does: each step, the tokens each row
decoded, with the row's cache once it ended (an end-of-sequence token or its
max_tokens). Nothing is merged or copied when a row joins or leaves: a row's
cache stays the one admission allocated for it (engine/cache/kv_cache.py).

A plain step runs one step ahead, as mlx-lm's generators do: it builds the
next step's forward on the tokens it sampled, lazily, and starts it before
it reads those tokens, so the device works while the host relays them. A
row that ends has had one more token computed than it takes: that token is
dropped (its KV holds everything up to the last token it answered).

Prompt lookup (engine/model/speculative.py) is a per-row part of the same
step (`lookup`): each row's n-gram index proposes what followed its last
tokens earlier in its context, its DraftPolicy how many are worth a verify;
when a row has proposals, the step runs every row's last token and its
proposals in one forward (a verify step, each row's attention causal over
its own keys), each row keeps the longest prefix its own model agrees with
(greedy) or what the speculative acceptance rule keeps (sampled), and its
cache is cut back to what it kept. Rows with logits processors (penalties,
a grammar) propose nothing; a verify step is not run one ahead (what comes
next depends on what was kept), so it is taken only where a row has
something to propose: rows that copy nothing pay a dictionary lookup a token.

Quantised KV (`kv_bits`) batches too: each row's quantised layers go to
mlx-lm's quantised attention with its own cache, as alone; a row's plain
layers are quantised once they hold the layout's start (as mlx-lm's
generate_step does); where this MLX has no kernel for attention over
quantised KV, a step reads each layer dequantised (`dequantized`), as the
one-row decoder does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, TokenBuffer, can_trim_prompt_cache, trim_prompt_cache

from mlxd.memory_estimate import KVLayout

from ..cache.kv_cache import prefill_views, quantize_from
from .row_attention import positions, row_caches
from .speculative import DRAFT_MAX, DraftPolicy, NgramIndex, SampledTarget, SpecStats, accept_sampled


@dataclass(eq=False)
class _Row:
    uid: int
    kv: list[Any]
    next_input: mx.array  # [1]: what the next step runs through the model (lazy once sampled)
    max_tokens: int
    sampler: Any  # None: greedy
    processors: list[Any]
    context: TokenBuffer | None  # the tokens its KV holds, for its processors (penalties, a grammar)
    lookup: NgramIndex | None = None  # its prompt and answer's n-grams, where it proposes (prompt lookup)
    target: SampledTarget | None = None  # a sampled row's distribution, for verifying (None: greedy)
    policy: DraftPolicy = field(default_factory=DraftPolicy)
    stats: SpecStats = field(default_factory=SpecStats)
    answered: int = 0
    plain_layers: bool = False  # layers still at the model's dtype that kv_bits quantises once they reach its start
    joining: bool = True  # its first input is its prompt's last token, not a token it answered

    def room(self) -> int:
        """Tokens it may still propose: its answer's rest, less the one a verify always gives."""
        return min(DRAFT_MAX, self.max_tokens - self.answered - 2)


@dataclass(frozen=True)
class RowToken:
    """A token a row decoded in a step; its cache when the row ended with it."""

    uid: int
    token: int
    finish_reason: str | None
    prompt_cache: list[Any] | None = None
    speculation: SpecStats | None = None  # what prompt lookup did for the row, once it ended


@dataclass
class RowBatch:
    model: Any
    stop_tokens: frozenset[int]
    lookup: bool = False  # prompt lookup in the batch: the model's verify step was found exact at load
    kv_layout: KVLayout = KVLayout()  # kv_bits: rows' layers quantised once they hold its start (as alone)
    dequantized: bool = False  # this MLX cannot attend over quantised KV: a step reads it dequantised, a layer at a time
    rows: list[_Row] = field(default_factory=list)
    _next_uid: int = 0

    def insert(self, token: int, kv: list[Any], max_tokens: int, context: list[int], sampler: Any,
               processors: list[Any], target: SampledTarget | None = None) -> int:
        """A row joins with the token it runs next (its prompt's last); `context`: the tokens its KV holds."""
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        proposes = self.lookup and not processors and can_trim_prompt_cache(kv)
        self.rows.append(_Row(uid, kv, mx.array([token], dtype=mx.int32), max_tokens, sampler, list(processors),
                              TokenBuffer(list(context)) if processors else None,
                              NgramIndex([*context, token]) if proposes else None, target,
                              plain_layers=self.kv_layout.quantized and _has_plain_layers(kv)))
        return uid

    def remove(self, uid: int) -> list[Any] | None:
        """A row out of the batch (ended by its request: a stop string, a
        cancel), with its cache; the token computed for it ahead is dropped."""
        row = next((r for r in self.rows if r.uid == uid), None)
        if row is None:
            return None
        self.rows.remove(row)
        return row.kv

    def spec_stats(self, uid: int) -> SpecStats | None:
        row = next((r for r in self.rows if r.uid == uid), None)
        return row.stats if row is not None and row.lookup is not None else None

    def close(self) -> None:
        self.rows = []

    def next(self) -> list[RowToken]:
        """One step: the next tokens of every row (none for a row that has just joined)."""
        rows = list(self.rows)
        if not rows:
            return []
        if any(self._may_propose(r) for r in rows):
            return self._verify_step(rows)
        began = time.perf_counter()
        inputs = rows[0].next_input if len(rows) == 1 else mx.concatenate([r.next_input for r in rows])
        with mx.stream(generation_stream):
            logits = self.model(inputs[:, None], cache=self._caches(rows))[:, -1, :]
            sampled, contexts = self._sample(rows, logits, inputs)
        for i, r in enumerate(rows):
            r.next_input = sampled[i:i + 1]
        self._quantize(rows)
        mx.async_eval(sampled, *contexts)  # the next step's tokens computed while these are relayed
        tokens = inputs.tolist()
        seconds = time.perf_counter() - began
        out = []
        for r, token in zip(rows, tokens):
            if r.lookup is not None:
                r.policy.saw_step(seconds)
                r.stats.forwards += 1
            out += self._answer(r, [token])
        return out

    def _caches(self, rows: list[_Row]) -> list[Any]:
        kv = [prefill_views(r.kv) if self.dequantized else r.kv for r in rows]
        return row_caches(kv, positions(kv))

    def _quantize(self, rows: list[_Row]) -> None:
        """kv_bits: a row's plain layers quantised in place once they hold
        `quantized_start` positions, as mlx-lm's generate_step does alone."""
        for r in rows:
            if r.plain_layers:
                quantize_from(r.kv, self.kv_layout)
                r.plain_layers = _has_plain_layers(r.kv)

    def _sample(self, rows: list[_Row], logits: mx.array, inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """Each row's processors and sampler over its logits (one position a row): the tokens drawn."""
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

    # --- prompt lookup -------------------------------------------------------------------------
    def _may_propose(self, r: _Row) -> bool:
        """Whether the row has proposals worth a verify, judged on the tokens
        known (its next token is still being computed: the index's first
        proposal stands for it)."""
        if r.lookup is None or r.room() < 1:
            return False
        at_hand = r.lookup.propose(1 + r.room())
        return len(at_hand) > 1 and r.policy.next_k(len(at_hand) - 1) > 0

    def _verify_step(self, rows: list[_Row]) -> list[RowToken]:
        """Every row's next token and its proposals in one forward; each row
        keeps what its model agrees with and its cache is cut back to it."""
        began = time.perf_counter()
        lasts = mx.concatenate([r.next_input for r in rows]).tolist()  # (waits for the step ahead)
        proposals = []
        for r, last in zip(rows, lasts):
            if r.lookup is None or r.room() < 1:
                proposals.append([])
                continue
            if not r.joining:
                r.lookup.extend([last])  # its answer's next token (a joining row's prompt already has it)
            at_hand = r.lookup.propose(r.room())
            proposals.append(at_hand[:r.policy.next_k(len(at_hand))])
        width = 1 + max(len(p) for p in proposals)
        inputs = mx.array([[last, *p, *[last] * (width - 1 - len(p))] for last, p in zip(lasts, proposals)],
                          dtype=mx.int32)
        with mx.stream(generation_stream):
            logits = self.model(inputs, cache=self._caches(rows))
            firsts, _ = self._sample(rows, logits[:, 0, :], inputs[:, 0])
            greedy = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).argmax(axis=-1)
        mx.eval(firsts, greedy)
        firsts_list, greedy_list = firsts.tolist(), greedy.tolist()
        seconds = time.perf_counter() - began
        out = []
        for i, (r, last, proposed) in enumerate(zip(rows, lasts, proposals)):
            if not proposed:
                kept, after = [], firsts_list[i]
            elif r.target is None:
                agreed = 0
                while agreed < len(proposed) and proposed[agreed] == greedy_list[i][agreed]:
                    agreed += 1
                kept, after = proposed[:agreed], greedy_list[i][agreed]
            else:
                drawn = accept_sampled(r.target.probs(logits[i, :len(proposed) + 1].astype(mx.float32)), proposed)
                kept, after = drawn[:-1], drawn[-1]
            if width > 1 + len(kept):
                trim_prompt_cache(r.kv, width - 1 - len(kept))
            r.next_input = mx.array([after], dtype=mx.int32)
            if r.lookup is not None:
                r.stats.forwards += 1
                r.stats.proposed += len(proposed)
                r.stats.accepted += len(kept)
                if proposed:
                    r.policy.saw_verify(len(proposed), len(kept), seconds)
                r.lookup.extend(kept)
            out += self._answer(r, [last, *kept], indexed=True)
        self._quantize(rows)
        return out

    # --- the answer ----------------------------------------------------------------------------
    def _answer(self, r: _Row, tokens: list[int], indexed: bool = False) -> list[RowToken]:
        """The row's tokens of this step, in order, until one ends it: it
        then leaves with its cache, cut back to that token. `indexed`: its
        n-gram index has them already (a verify step's)."""
        out = []
        for n, token in enumerate(tokens):
            if r.joining:  # its prompt's last token: what it answers comes after
                r.joining = False
                continue
            if r.lookup is not None and not indexed:
                shadow = r.lookup.propose(1)  # would the index have guessed it: the policy learns where copying is
                if shadow:
                    r.policy.saw_shadow(shadow[0] == token)
                r.lookup.extend([token])
            r.answered += 1
            r.stats.tokens += 1
            finish = "stop" if token in self.stop_tokens else "length" if r.answered >= r.max_tokens else None
            if finish is not None:
                self.rows.remove(r)
                if n + 1 < len(tokens):  # a verify's tokens after the one that ended it: out of its cache too
                    trim_prompt_cache(r.kv, len(tokens) - n - 1)
                out.append(RowToken(r.uid, token, finish, r.kv, r.stats if r.lookup is not None else None))
                return out
            out.append(RowToken(r.uid, token, None))
        return out


def _has_plain_layers(kv: list[Any]) -> bool:
    return any(isinstance(c, KVCache) for c in kv)
