"""The decoder's step, mlxd's own: rows of any length, each with its own
cache, a token a row each step (engine/model/row_attention.py: the matrix
products together, attention row by row without a mask). One request
alone is a batch of one, and its step is the model's forward over its own
cache, as mlx-lm's generate_step runs it.

A row joins with the token it decodes next, its cache, its sampler and
logits processors (penalties, logit bias, a grammar); each step answers the
tokens each row decoded, with the row's cache once it ended (an
end-of-sequence token or its max_tokens). Nothing is merged or copied when
a row joins or leaves: a row's cache stays the one admission allocated for
it (engine/cache/kv_cache.py).

A plain step runs one step ahead, as mlx-lm's generators do: it builds the
next step's forward on the tokens it sampled, lazily, and starts it before
it reads those tokens, so the device works while the host relays them. A
row that ends has had one more token computed than it takes: that token is
dropped (its KV holds everything up to the last token it answered).

Speculative decoding is a per-row part of the same step: a row with a
proposer (engine/model/row_proposals.py: prompt lookup, a draft model) may
propose tokens; when one has proposals worth a verify, the step runs every
row's last token and its proposals in one forward (a verify step, each
row's attention causal over its own keys), each row keeps the longest
prefix its model agrees with (greedy) or what the speculative acceptance
rule keeps (sampled), and its cache is cut back to what it kept. A row's
grammar masks every position of its verify (a proposal is cut where the
grammar would not allow it); rows with penalties propose nothing (they
must see each token before the next is drawn). A verify step is not run
one ahead (what comes next depends on what was kept).

A model whose attention reads the keys itself (DeepSeek's latent
attention: engine/model/row_attention.py's rows_decode_exact fails) runs a
forward a row (`apart` False): the same step, the same tokens, no matrix
products shared.

Quantised KV (`kv_bits`) batches too: each row's quantised layers go to
mlx-lm's quantised attention with its own cache, as alone; a row's plain
layers are quantised once they hold the layout's start (as mlx-lm's
generate_step does); where this MLX has no kernel for attention over
quantised KV, a step reads each layer dequantised (`dequantized`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, TokenBuffer, trim_prompt_cache

from mlxd.memory_estimate import KVLayout

from ..cache.kv_cache import prefill_views, quantize_from
from ..cache.prompt_cache import kv_offset
from .row_attention import positions, row_caches
from .row_proposals import Proposer
from .row_segments import forward_segments, forward_step
from .speculative import DRAFT_MAX, SampledTarget, SpecStats, accept_sampled, apply_masks

if TYPE_CHECKING:
    from .constrained import GrammarProcessor


@dataclass(eq=False)
class _Row:
    uid: int
    kv: list[Any]
    next_input: mx.array  # [1]: what the next step runs through the model (lazy once sampled)
    max_tokens: int
    sampler: Any  # None: greedy
    processors: list[Any]  # its logits processors but its grammar (penalties, logit bias)
    context: TokenBuffer | None  # the tokens its KV holds, for its processors
    proposer: Proposer | None = None  # what it proposes for a verify (engine/model/row_proposals.py)
    target: SampledTarget | None = None  # a sampled row's distribution, for verifying (None: greedy)
    grammar: GrammarProcessor | None = None  # applied last, after its processors, driven by the step by hand
    answered: int = 0
    plain_layers: bool = False  # layers still at the model's dtype that kv_bits quantises once they reach its start
    joining: bool = True  # its first input is its prompt's last token, not a token it answered
    input_answered: bool = False  # its next input is a token it has answered already (its first: see `next`)

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
    speculation: SpecStats | None = None  # what speculation did for the row, once it ended


@dataclass
class RowBatch:
    model: Any
    stop_tokens: frozenset[int]
    apart: bool = True  # one forward over every row, attention row by row; False: a forward a row
    # Verify steps over several rows in one forward were found exact at the model's load (a batch of one's, or
    # a forward a row's, always are).
    verify_together: bool = False
    kv_layout: KVLayout = KVLayout()  # kv_bits: rows' layers quantised once they hold its start (as alone)
    dequantized: bool = False  # this MLX cannot attend over quantised KV: a step reads it dequantised, a layer at a time
    rows: list[_Row] = field(default_factory=list)
    _next_uid: int = 0

    def insert(self, token: int, kv: list[Any], max_tokens: int, context: list[int], sampler: Any,
               processors: list[Any], target: SampledTarget | None = None, proposer: Proposer | None = None,
               grammar: GrammarProcessor | None = None) -> int:
        """A row joins with the token it runs next (its prompt's last); `context`: the tokens its KV holds."""
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        others = [p for p in processors if p is not grammar]  # a grammar is driven by hand (`_grammar_masks`)
        self.rows.append(_Row(uid, kv, mx.array([token], dtype=mx.int32), max_tokens, sampler, others,
                              TokenBuffer(list(context)) if others else None, proposer, target, grammar,
                              plain_layers=self.kv_layout.quantized and _has_plain_layers(kv)))
        return uid

    def remove(self, uid: int) -> list[Any] | None:
        """A row out of the batch (ended by its request: a stop string, a
        cancel), with its cache; the token computed for it ahead is dropped."""
        row = next((r for r in self.rows if r.uid == uid), None)
        if row is None:
            return None
        self.rows.remove(row)
        if row.proposer is not None:
            row.proposer.ended()
        return row.kv

    def spec_stats(self, uid: int) -> SpecStats | None:
        row = next((r for r in self.rows if r.uid == uid), None)
        return row.proposer.stats if row is not None and row.proposer is not None else None

    def close(self) -> None:
        for r in self.rows:
            if r.proposer is not None:
                r.proposer.ended()
        self.rows = []

    def next(self, chunks: Sequence[tuple[list[Any], list[int]]] = ()) -> list[RowToken]:
        """One step: the next tokens of every row (a joining row's first).
        `chunks`: prompt chunks of rows still prefilling, (their cache, the
        tokens), run in the same forward (engine/model/row_segments.py; the
        batch decoder passes them where the load found that exact); such a
        step verifies nothing."""
        rows = list(self.rows)
        if not rows and not chunks:
            return []
        if not chunks and (len(rows) == 1 or self.verify_together or not self.apart) and \
                any(r.proposer is not None and r.proposer.worth_verify(self._room(r)) for r in rows):
            return self._verify_step(rows)
        began = time.perf_counter()
        if not rows:  # the chunks alone, each into its own cache
            with mx.stream(generation_stream):
                forward_segments(self.model, [kv for kv, _ in chunks], _chunk_tokens(chunks),
                                 [len(part) for _, part in chunks])
                mx.eval(_chunk_arrays(chunks))
            return []
        inputs = rows[0].next_input if len(rows) == 1 else mx.concatenate([r.next_input for r in rows])
        with mx.stream(generation_stream):
            if chunks:  # the rows' tokens, then each chunk's: one sequence (engine/model/row_segments.py)
                tokens = mx.concatenate([inputs, _chunk_tokens(chunks)])
                lengths = [1] * len(rows) + [len(part) for _, part in chunks]
                caches = [r.kv for r in rows] + [kv for kv, _ in chunks]
                logits = forward_step(self.model, caches, tokens, lengths, len(rows))
            else:
                logits = self._forward(rows, inputs[:, None])[:, -1, :]
            sampled, contexts = self._sample(rows, logits, inputs, self._grammar_masks(rows, logits, inputs))
        for i, r in enumerate(rows):
            r.next_input = sampled[i:i + 1]
        self._quantize(rows)
        # The next step's tokens computed while these are relayed (and a chunk's KV with them).
        mx.async_eval(sampled, *contexts, *_chunk_arrays(chunks))
        tokens = inputs.tolist()
        # A joining row's first token goes out in this step, not the next: its TTFT is a forward, not two
        # (the other rows' tokens are this step's inputs, as always; only this step waits for its forward).
        firsts = sampled.tolist() if any(r.joining for r in rows) else None
        seconds = time.perf_counter() - began
        out = []
        for i, (r, token) in enumerate(zip(rows, tokens)):
            if r.proposer is not None:
                r.proposer.plain(token, r.joining, seconds)
            first_now = firsts is not None and r.joining
            out += self._answer(r, [token, firsts[i]] if first_now else [token])
            r.input_answered = first_now
        return out

    def _forward(self, rows: list[_Row], inputs: mx.array) -> mx.array:
        """The rows' logits for `inputs` (rows x positions): one forward over
        their own caches (a batch of one: the model over the row's cache, as
        mlx-lm runs one), or a forward a row where attention cannot be split."""
        kv = [prefill_views(r.kv) if self.dequantized else r.kv for r in rows]
        if len(rows) == 1:
            return self.model(inputs, cache=kv[0])
        if not self.apart:
            return mx.concatenate([self.model(inputs[i:i + 1], cache=c) for i, c in enumerate(kv)], axis=0)
        return self.model(inputs, cache=row_caches(kv, positions(kv)))

    def _quantize(self, rows: list[_Row]) -> None:
        """kv_bits: a row's plain layers quantised in place once they hold
        `quantized_start` positions, as mlx-lm's generate_step does alone."""
        for r in rows:
            if r.plain_layers:
                quantize_from(r.kv, self.kv_layout)
                r.plain_layers = _has_plain_layers(r.kv)

    def _grammar_masks(self, rows: list[_Row], logits: mx.array, inputs: mx.array) -> list[Any] | None:
        """A plain step's grammar masks, one per row (None: no grammar): each
        grammar takes the row's input token, then all rows' masks are made at
        once (constrained.step_masks) while the step's forward runs."""
        bound = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not bound:
            return None
        from .constrained import step_masks

        mx.async_eval(logits)  # the device computes while the host makes the masks
        tokens = inputs.tolist()  # the tokens the rows' grammars take now (waits for the step before)
        for i in bound:
            rows[i].grammar.catch_up(tokens[i])
        allowed = step_masks([rows[i].grammar for i in bound], logits.shape[-1])
        masks: list[Any] = [None] * len(rows)
        for k, i in enumerate(bound):
            masks[i] = allowed[k:k + 1]
        return masks

    def _sample(self, rows: list[_Row], logits: mx.array, inputs: mx.array,
                masks: list[Any] | None = None) -> tuple[mx.array, list[mx.array]]:
        """Each row's processors, its grammar's mask (`masks`: per row, an
        array of allowed tokens, or a verify's host masks, or None) and its
        sampler over its logits (one position a row): the tokens drawn."""
        contexts = []
        if any(r.processors for r in rows) or masks is not None:
            processed = []
            for i, r in enumerate(rows):
                row_logits = logits[i:i + 1]
                if r.processors:
                    context = r.context.update_and_fetch(inputs[i:i + 1])
                    contexts.append(context)
                    for processor in r.processors:
                        row_logits = processor(context, row_logits)
                if masks is not None and masks[i] is not None:
                    m = masks[i]
                    row_logits = (mx.where(m, row_logits, mx.array(-float("inf"), dtype=row_logits.dtype))
                                  if isinstance(m, mx.array) else apply_masks(row_logits, m[:1]))
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

    # --- speculation ----------------------------------------------------------------------------
    def _room(self, r: _Row) -> int:
        """Tokens the row may propose now: its answer's rest, and under
        kv_bits none that would run its plain layers past the layout's start
        within one verify (a plain step quantises them first: alone, the
        tokens after the start attend to quantised keys)."""
        room = r.room()
        if r.plain_layers:
            room = min(room, self.kv_layout.quantized_start - kv_offset(r.kv) - 1)
        return room

    def _verify_step(self, rows: list[_Row]) -> list[RowToken]:
        """Every row's next token and its proposals in one forward; each row
        keeps what its model agrees with and its cache is cut back to it."""
        began = time.perf_counter()
        lasts = mx.concatenate([r.next_input for r in rows]).tolist()  # (waits for the step ahead)
        proposals, masks = [], []
        for r, last in zip(rows, lasts):
            if r.grammar is not None:
                r.grammar.catch_up(last)
            proposed = r.proposer.propose(last, r.joining, self._room(r)) if r.proposer is not None else []
            row_masks = None
            if r.grammar is not None:  # cut where the grammar would not allow it, each position masked
                proposed, row_masks = r.grammar.masks_along(proposed)
            proposals.append(proposed)
            masks.append(row_masks)
        width = 1 + max(len(p) for p in proposals)
        inputs = mx.array([[last, *p, *[last] * (width - 1 - len(p))] for last, p in zip(lasts, proposals)],
                          dtype=mx.int32)
        with mx.stream(generation_stream):
            logits = self._forward(rows, inputs)
            firsts, _ = self._sample(rows, logits[:, 0, :], inputs[:, 0], masks)
            if any(m is not None for m in masks):  # each grammar row's positions under its own masks
                greedy = [None if not p or r.target is not None else
                          _greedy(apply_masks(logits[i, :len(p) + 1], masks[i]))
                          for i, (r, p) in enumerate(zip(rows, proposals))]
            else:  # every row's positions in one reduction
                every = _greedy(logits)
                greedy = [every[i] for i in range(len(rows))]
        mx.eval(firsts, *[g for g in greedy if g is not None])
        firsts_list = firsts.tolist()
        seconds = time.perf_counter() - began
        out = []
        for i, (r, last, proposed) in enumerate(zip(rows, lasts, proposals)):
            if not proposed:
                kept, after = [], firsts_list[i]
            elif r.target is None:
                choice = greedy[i].tolist()
                agreed = 0
                while agreed < len(proposed) and proposed[agreed] == choice[agreed]:
                    agreed += 1
                kept, after = proposed[:agreed], choice[agreed]
            else:
                row_logits = apply_masks(logits[i, :len(proposed) + 1], masks[i])
                drawn = accept_sampled(r.target.probs(row_logits.astype(mx.float32)), proposed)
                kept, after = drawn[:-1], drawn[-1]
            if width > 1 + len(kept):
                trim_prompt_cache(r.kv, width - 1 - len(kept))
            r.next_input = mx.array([after], dtype=mx.int32)
            if kept and r.context is not None:
                r.context.update_and_fetch(mx.array(kept, dtype=mx.int32))
            if r.grammar is not None:
                r.grammar.took(kept)
            if r.proposer is not None:
                r.proposer.verified(proposed, kept, seconds)
            out += self._answer(r, [last, *kept])
        self._quantize(rows)
        return out

    # --- the answer ----------------------------------------------------------------------------
    def _answer(self, r: _Row, tokens: list[int]) -> list[RowToken]:
        """The row's tokens of this step, in order, until one ends it: it
        then leaves with its cache, cut back to that token."""
        out = []
        for n, token in enumerate(tokens):
            if n == 0 and (r.joining or r.input_answered):  # its prompt's last token, or one it answered already
                r.joining = r.input_answered = False
                continue
            r.answered += 1
            if r.proposer is not None:
                r.proposer.stats.tokens += 1
            finish = "stop" if token in self.stop_tokens else "length" if r.answered >= r.max_tokens else None
            if finish is not None:
                self.rows.remove(r)
                if n + 1 < len(tokens):  # a verify's tokens after the one that ended it: out of its cache too
                    trim_prompt_cache(r.kv, len(tokens) - n - 1)
                if r.proposer is not None:
                    r.proposer.ended()
                out.append(RowToken(r.uid, token, finish, r.kv, r.proposer.stats if r.proposer is not None else None))
                return out
            out.append(RowToken(r.uid, token, None))
        return out


def _greedy(logits: mx.array) -> mx.array:
    """Each position's greedy token, as a plain step picks it (argmax of the log-probabilities)."""
    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).argmax(axis=-1)


def _chunk_tokens(chunks: Sequence[tuple[list[Any], list[int]]]) -> mx.array:
    return mx.array([t for _, part in chunks for t in part], dtype=mx.int32)


def _chunk_arrays(chunks: Sequence[tuple[list[Any], list[int]]]) -> list[mx.array]:
    """The chunks' caches' arrays, to evaluate with the step."""
    return [a for kv, _ in chunks for c in kv for a in (c.keys, c.values)]


def _has_plain_layers(kv: list[Any]) -> bool:
    return any(isinstance(c, KVCache) for c in kv)
