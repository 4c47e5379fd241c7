"""The decoder of text requests: the running requests decoded as one batch by
mlxd's RowBatch (engine/model/row_batch.py: each row over its own cache, a
token a row each step); a request alone is a batch of one. Every request
with `max_concurrency` = 1, a seed, a rank group's: the same step.

A joining request's prompt is prefilled by itself, a paced chunk a step
(engine/model/prefill.py), between the batch's decode steps, and joins the
batch with its last token: the rows already decoding get a step after
every chunk, so a long prompt joining does not stop their answers.
(Figures: docs/BENCHMARKS.md, "Batched prefill at full speed".) A joining
row whose prompt starts as a decoding row's takes that row's KV of the
shared part instead of prefilling it again (`_borrow_prefix`).

Each request keeps all it has alone: its sampler and penalties, its
grammar, its speculation (engine/model/row_proposals.py: prompt lookup, a
draft model), its Generation (stop strings, reasoning and tool-call
parsing, deadline, cancellation), its detokenizer. A request's KV is its
own, allocated at admission for the length admission granted it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .decoder_rows import CHECKPOINT_TOKENS, Admitted, Ended, RowSampling
from .faults import FaultInjector
from .generation import ResidentModel
from .prefill import prefill
from .prefill_pace import ALIGN, PrefillPace, aligned_chunk
from .speculative import SampledTarget

if TYPE_CHECKING:  # (they import MLX: the engine's entry point must not, before its BLAS choice)
    from .draft_model import DraftModel
    from .ranks import RankLink
    from .row_batch import RowBatch
    from .row_proposals import Proposer

log = logging.getLogger("mlxd.engine.core.worker")


@dataclass(eq=False)
class _Prefilling:
    """A request whose prompt is being prefilled by itself before it joins the batch."""

    key: int  # its key among the rows until the batch gives it a uid (negative)
    admitted: Admitted
    kv: list[Any]
    context: list[int]  # the tokens its KV holds
    rest: list[int]  # the prompt after them; the last joins the batch as a one-token segment
    sampling: RowSampling
    saved: int = 0  # tokens of its KV last left on disk (Admitted.save_progress)
    looked: bool = False  # for a row of the batch whose prompt starts as its own (`_borrow_prefix`)


MIN_BORROWED_TOKENS = 128  # a shorter shared start is prefilled: the copy's ops would cost about as much


def shared_start(tokens: list[int], others: list[list[int]]) -> tuple[int, int]:
    """(which of `others`, how many tokens) starts as `tokens` does for the
    longest (pure; (-1, 0) where none shares a token)."""
    best, length = -1, 0
    mine = np.asarray(tokens, dtype=np.int64)
    for i, other in enumerate(others):
        n = min(len(mine), len(other))
        if n <= length:
            continue
        differ = np.flatnonzero(mine[:n] != np.asarray(other[:n], dtype=np.int64))
        same = int(differ[0]) if differ.size else n
        if same > length:
            best, length = i, same
    return best, length


def widened(kv: list[Any], context: list[int], chunk: list[int], align: int = ALIGN) -> tuple[list[int], int]:
    """The tokens a step runs for a prompt chunk that follows `context` in
    `kv`, widened to whole steps (prefill_pace.aligned_chunk): the cache is
    rewound to the start, so the cached tokens from there run again, and
    padding follows the chunk; and how many tokens are padding, for the
    caller to cut from the cache's offset after the step. As it is where the
    cache is not an allocated buffer that holds the end."""
    from mlx_lm.models.cache import trim_prompt_cache

    from ..cache.kv_cache import AllocatedKVCache

    c = kv[0]
    if not all(isinstance(layer, AllocatedKVCache) for layer in kv) or c.keys is None or c.offset != len(context):
        return chunk, 0
    offset = c.offset
    start, end = aligned_chunk(offset, len(chunk), c.keys.shape[2], align)
    if start < offset:
        trim_prompt_cache(kv, offset - start)
    padding = end - offset - len(chunk)
    return context[start:offset] + chunk + [chunk[-1]] * padding, padding


def speculates(speculative: str, penalties: bool, grammar: bool, harmony: bool, trimmable: bool) -> str:
    """How a row speculates (pure): "prompt_lookup", "draft" or "off". Not
    with penalties (they must see each token before the next is drawn), nor
    over a cache that cannot be cut back; a draft not under a grammar; prompt
    lookup not under a harmony grammar (its forced markers ended bound
    answers early: the model zoo's gpt-oss, an open bug)."""
    if speculative == "off" or penalties or not trimmable:
        return "off"
    if speculative == "draft":
        return "off" if grammar else "draft"
    return "off" if grammar and harmony else speculative


class BatchDecoder:
    def __init__(self, resident: ResidentModel, pace: PrefillPace, faults: FaultInjector | None = None,
                 apart: bool = True, verify_together: bool = False, speculative: str = "off",
                 draft: DraftModel | None = None, draft_tokens: int = 3, link: RankLink | None = None,
                 mixes: bool = False, aligned: bool = False) -> None:
        from .row_batch import RowBatch

        self.resident = resident
        self.pace = pace  # the size of each prefill chunk a joining row is given, from the speed measured
        self.faults = faults
        self.speculative = speculative  # the serving plan's
        self.draft = draft  # its DraftModel when the plan says "draft" (engine/model/draft_model.py)
        self.draft_tokens = draft_tokens
        self.link = link  # rank 0 of a rank group: the other ranks keep a KV of their shard from BEGIN to END
        self.mixes = mixes  # joining prompts' chunks in the decode step's forward (row_segments.py): the plan's
        self.aligned = aligned  # those chunks widened to whole steps (prefill_pace.aligned_chunk): MLX's CUDA backend
        self.batch: RowBatch = RowBatch(resident.model, frozenset(resident.tokenizer.eos_token_ids), apart=apart,
                                        verify_together=verify_together, kv_layout=resident.kv,
                                        dequantized=resident.dequantized_decode)
        self.rows: dict[int, Admitted] = {}
        self._prefilling: list[_Prefilling] = []  # in order of admission; the first is prefilled a chunk a step
        self._next_key = -2

    def close(self) -> None:
        if self.rows and self.link is not None:
            from .ranks import END

            self.link.share((END,))
        self.batch.close()
        self.rows.clear()
        self._prefilling = []

    def admit(self, admitted: Admitted, kv: list[Any] | None, sampling: RowSampling) -> None:
        """Into the batch: its prompt after the cached part is prefilled by
        itself, a chunk a step (`_prefill_chunk`), then it decodes with the rest."""
        job = admitted.job
        if job.params.seed is not None:  # served alone: its answer is the same every time
            import mlx.core as mx

            mx.random.seed(job.params.seed)
        if self.link is not None:
            from .ranks import BEGIN

            self.link.share((BEGIN,))  # the other ranks keep a KV cache of their own shard until END
        if kv is None:  # a rank group's shard: no prompt cache of ours
            from mlx_lm.models.cache import make_prompt_cache

            kv = make_prompt_cache(self.resident.model)
        prompt, start = admitted.prompt, admitted.fetched.start
        rest = prompt[start:]
        if admitted.needs_snapshot and len(rest) == 1:
            admitted.snapshot = _snapshot(kv)  # the cache already holds the prompt's boundary
        if len(rest) == 1:
            self._insert(admitted, rest, kv, prompt[:start], sampling)
            return
        key, self._next_key = self._next_key, self._next_key - 1
        self._prefilling.append(_Prefilling(key, admitted, kv, prompt[:start], rest, sampling))
        self.rows[key] = admitted

    def _proposer(self, a: Admitted, kv: list[Any], context: list[int], token: int,
                  sampling: RowSampling) -> Proposer | None:
        """What the row proposes for verify steps (engine/model/row_proposals.py), by `speculates`."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        from .row_proposals import DraftProposer, LookupProposer

        grammar = a.generation.grammar
        mode = speculates(self.speculative, any(q is not grammar for q in sampling.processors), grammar is not None,
                          getattr(self.resident.tool_format, "body", None) == "harmony", can_trim_prompt_cache(kv))
        if mode == "prompt_lookup":
            return LookupProposer([*context, token], grammar)
        if mode == "draft" and self.draft is not None:
            draft_kv = self.draft.take(context)  # None: another row drafts (one draft KV is counted)
            return DraftProposer(self.draft, draft_kv, context, self.draft_tokens) if draft_kv is not None else None
        return None

    def _insert(self, a: Admitted, segment: list[int], kv: list[Any], context: list[int],
                sampling: RowSampling) -> None:
        """A row into the batch, with its KV and its prompt's last token."""
        token = segment[-1]
        uid = self.batch.insert(token, kv, a.job.params.max_tokens, context, sampling.sampler, sampling.processors,
                                SampledTarget.of(a.job.params, self.resident.vocab_size()),
                                self._proposer(a, kv, context, token, sampling), a.generation.grammar)
        self.rows[uid] = a

    def _prefill_chunk(self) -> None:
        """One paced chunk of the first joining request's prompt, alone; the
        request joins the batch once only its last token is left."""
        p = self._prefilling[0]
        if not self._looked(p):
            return
        chunk = p.rest[:min(self.pace.step(), len(p.rest) - 1)]
        prefill(self.resident.model, p.kv, chunk, self.pace, lambda: None, self.faults, self.resident.kv)
        self._took(p, chunk)

    def _looked(self, p: _Prefilling) -> bool:
        """Its prompt's start taken from a decoding row where one holds it
        (once); False when that left only its last token: it joined."""
        if not p.looked:
            p.looked = True
            self._borrow_prefix(p)
            if len(p.rest) == 1:
                self._joined(p)
                return False
        return True

    def _took(self, p: _Prefilling, chunk: list[int]) -> None:
        """A chunk of its prompt is in its KV: on disk as it goes (a long
        prompt's), into the batch once only its last token is left."""
        p.context += chunk
        p.rest = p.rest[len(chunk):]
        if len(p.rest) > 1:
            a = p.admitted
            if a.save_progress is not None and len(p.context) - max(p.saved, a.fetched.start) >= CHECKPOINT_TOKENS:
                a.save_progress(a, p.kv, len(p.context))  # a long prompt's KV to disk as it goes
                p.saved = len(p.context)
            return
        self._joined(p)

    def _chunks(self) -> list[tuple[_Prefilling, list[int]]]:
        """This step's prompt chunks: the joining requests' next tokens, in
        order of admission, within the pace's budget (a token budget a step,
        as vLLM schedules prefill chunks beside decode tokens)."""
        budget, out, queue = self.pace.step(), [], list(self._prefilling)
        for k, p in enumerate(queue):
            if budget <= 0:
                break
            if not p.looked and self._shares_with([q for q in queue[:k] if q in self._prefilling], p):
                break  # it waits for the one ahead to join, and takes that part of its KV then (`_borrow_prefix`)
            if not self._looked(p):
                continue
            n = min(budget, len(p.rest) - 1)
            if n <= 0:
                break
            out.append((p, p.rest[:n]))
            budget -= n
        return out

    @staticmethod
    def _shares_with(ahead: list[_Prefilling], p: _Prefilling) -> bool:
        """Whether p's prompt starts as one still prefilling ahead of it, for enough tokens to take them."""
        if not ahead:
            return False
        _, n = shared_start(p.context + p.rest[:-1], [q.context + q.rest for q in ahead])
        return n - len(p.context) >= MIN_BORROWED_TOKENS

    def _mixed_step(self) -> list[Ended]:
        """The joining prompts' chunks and a token for every decoding row, in one forward."""
        from mlx_lm.models.cache import trim_prompt_cache

        chunks = self._chunks()  # (a row whose prompt a decoding row held joins now: it decodes in this step)
        began = time.perf_counter()
        # (tokens run, padding) a chunk: widened to whole steps where `aligned`
        runs = [widened(p.kv, p.context, chunk) if self.aligned else (chunk, 0) for p, chunk in chunks]
        ended = self._decode_step([(p.kv, tokens) for (p, _), (tokens, _) in zip(chunks, runs)]) \
            if chunks or self.batch.rows else []
        for (p, _), (_, padding) in zip(chunks, runs):
            if padding:  # the padding's KV stays past the row's tokens, out of its offset: the next token overwrites it
                trim_prompt_cache(p.kv, padding)
        if chunks:
            n = sum(len(chunk) for _, chunk in chunks)
            if self.faults is not None and (delay := self.faults.prefill_delay_s(n)):
                time.sleep(delay)  # slow@prefill: a slow machine, for the tests
            self.pace.observe(n, time.perf_counter() - began)
        for p, chunk in chunks:
            self._took(p, chunk)
        return ended

    def _borrow_prefix(self, p: _Prefilling) -> None:
        """Agents that share a system prompt join together, before any of
        them is in the prompt cache: a joining row whose prompt starts as a
        decoding row's takes that part of its KV (a device copy) instead of
        prefilling it again (engine/cache/kv_cache.py's copy_prefix)."""
        from ..cache.kv_cache import copy_prefix

        others = [(self.rows[r.uid].prompt[:-1], r.kv) for r in self.batch.rows if r.uid in self.rows]
        which, n = shared_start(p.context + p.rest[:-1], [prompt for prompt, _ in others])
        if n - len(p.context) < MIN_BORROWED_TOKENS or not copy_prefix(p.kv, others[which][1], n):
            return
        taken = n - len(p.context)
        p.context += p.rest[:taken]
        p.rest = p.rest[taken:]
        a = p.admitted  # not computed by this turn: its answer reports them as cached, its prefill from here
        a.fetched = replace(a.fetched, start=n, cached_tokens=a.fetched.cached_tokens + taken)
        log.debug("a joining row took %d prompt tokens' KV from a decoding row", taken)

    def _joined(self, p: _Prefilling) -> None:
        """A row whose prompt is prefilled but its last token: into the batch."""
        self._prefilling.remove(p)
        a = self.rows.pop(p.key)
        a.prefilled = (p.kv, len(p.context))
        if a.needs_snapshot:
            a.snapshot = _snapshot(p.kv)  # the cache holds the prompt's boundary now
        self._insert(a, p.rest, p.kv, p.context, p.sampling)

    def step(self) -> list[Ended]:
        """One step of the batch: a token for every decoding request, with
        the joining requests' prompt chunks in the same forward where their
        caches mix (else a chunk of the first, by itself, before it). The
        requests that ended."""
        ended: list[Ended] = []
        if self._prefilling and self.mixes:
            ended = self._mixed_step()
        else:
            if self._prefilling:
                self._prefill_chunk()
            if len(self.rows) > len(self._prefilling):  # rows in the batch
                ended = self._decode_step()
        for uid, a in list(self.rows.items()):  # gone before their first token: cancelled in prefill
            if a.job.cancelled.is_set() and a.first_token_at is None:
                ended.append(self._remove(uid, "cancelled"))
        if ended and self.link is not None:
            from .ranks import END

            self.link.share((END,))
        return ended

    def _decode_step(self, chunks: list[tuple[list[Any], list[int]]] | None = None) -> list[Ended]:
        """A token for every row in the batch (a joining row's first step
        runs its prompt's last token), with `chunks` in the same forward."""
        began = time.perf_counter()
        responses = self.batch.next(chunks or ())
        if log.isEnabledFor(logging.DEBUG):  # where a batch's time goes
            log.debug("batch step %.1f ms: %d tokens decoded, %d prompt tokens, %d rows in the batch",
                      1000 * (time.perf_counter() - began), len(responses),
                      sum(len(c) for _, c in chunks or ()), len(self.rows))
        ended: list[Ended] = []
        for r in responses:
            a = self.rows.get(r.uid)
            if a is None:
                continue
            finish = a.feed(r.token, None, r.finish_reason)
            if r.finish_reason is not None:  # the batch ended it (and took it out)
                del self.rows[r.uid]
                ended.append(Ended(a, finish or r.finish_reason, self._kept(r.prompt_cache), r.speculation))
            elif finish is not None:
                ended.append(self._remove(r.uid, finish))
        return ended

    def _kept(self, kv: list[Any] | None) -> list[Any] | None:
        return None if self.link is not None else kv  # a rank group's shard: nothing for the prompt cache

    def _remove(self, uid: int, finish: str) -> Ended:
        a = self.rows.pop(uid)
        if uid < 0:  # still prefilling: nothing of it in the batch, nothing partial kept
            self._prefilling = [p for p in self._prefilling if p.key != uid]
            return Ended(a, finish, None)
        speculation = self.batch.spec_stats(uid)
        return Ended(a, finish, self._kept(self.batch.remove(uid)), speculation)


def _snapshot(kv: list[Any]) -> list[Any]:
    """The row's cache as of now, for the prompt cache: a cache that cannot
    be cut back once the answer is past the prompt (engine/cache/prompt_cache_policy.py)."""
    from ..cache.kv_cache import fitted

    return fitted(kv, copy_others=True)
