"""The many-row decoder (`max_concurrency` > 1): the running requests decoded
as one batch -- by mlxd's RowBatch (engine/model/row_batch.py: each row over
its own cache, attention row by row, no padding, no mask) where the model was
found to decode rows apart exactly at its load, else by mlx-lm's
BatchGenerator (padded rows behind a mask; what follows describes that one).

A joining request's prompt is prefilled by itself, a paced chunk a step
(engine/model/prefill.py, the one-row decoder's prefill), between the batch's
decode steps, and joins mlx-lm's batch with its last token: alone, attention
is MLX's fused causal kernel; in mlx-lm's batch, rows are padded and
attention takes an explicit mask (scores, their softmax and the mask, in
float32, over the whole context). So mlx-lm's batch only decodes: its own
prefill, whose step size it fixes when it is made, never runs. The decoding
rows get a step after every chunk, so a long prompt joining does not stop
their answers. (Figures: docs/BENCHMARKS.md, "Batched prefill at full speed".)

Each request keeps all it has alone: its sampler and penalties, its
Generation (stop strings, reasoning and tool-call parsing, deadline,
cancellation), its detokenizer. A request's KV is the batch's array, sized
when rows join for the length admission granted them (engine/cache/batch_kv.py).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .decoder_rows import CHECKPOINT_TOKENS, Admitted, Ended, RowSampling
from .faults import FaultInjector
from .generation import ResidentModel
from .one_row import Joining
from .prefill import prefill
from .prefill_pace import PrefillPace
from .speculative import SampledTarget

if TYPE_CHECKING:  # (they import MLX: the engine's entry point must not, before its BLAS choice)
    from mlx_lm.generate import BatchGenerator

    from .row_batch import RowBatch

log = logging.getLogger("mlxd.engine.core.worker")


def batchable_model(model: Any) -> bool:
    """Whether mlx-lm can batch this model: every layer's cache can be merged
    (mlx_lm.server asks the same)."""
    from mlx_lm.models.cache import make_prompt_cache

    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


@dataclass(eq=False)
class _Prefilling:
    """A request whose prompt is being prefilled by itself before it joins the batch."""

    key: int  # its key among the rows until mlx-lm's batch gives it a uid (negative)
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


class ManyRows:
    def __init__(self, resident: ResidentModel, slots: int, pace: PrefillPace, faults: FaultInjector | None = None,
                 rows_apart: bool = False, rows_lookup: bool = False) -> None:
        self.resident = resident
        self.pace = pace  # the size of each prefill chunk a joining row is given, from the speed measured
        self.faults = faults
        eos = sorted(resident.tokenizer.eos_token_ids)
        self.generator: BatchGenerator | None = None  # mlx-lm's, for a model whose rows cannot be decoded apart
        self.batch: RowBatch | None = None  # mlxd's (engine/model/row_batch.py)
        if rows_apart:
            from .row_batch import RowBatch

            self.batch = RowBatch(resident.model, frozenset(eos), lookup=rows_lookup, kv_layout=resident.kv,
                                  dequantized=resident.dequantized_decode)
        else:
            from mlx_lm.generate import BatchGenerator

            self.generator = BatchGenerator(resident.model, stop_tokens=[[t] for t in eos],
                                            completion_batch_size=slots, prefill_batch_size=slots)
        self.rows: dict[int, Admitted] = {}
        self._prefilling: list[_Prefilling] = []  # in order of admission; the first is prefilled a chunk a step
        self._next_key = -2

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
        if self.batch is not None:
            self.batch.close()

    def admit(self, admitted: Admitted, kv: list[Any], sampling: RowSampling) -> None:
        """Into the batch: its prompt after the cached part is prefilled by
        itself, a chunk a step (`_prefill_chunk`), then it decodes with the rest."""
        prompt, start = admitted.prompt, admitted.fetched.start
        rest = prompt[start:]
        if admitted.needs_snapshot and len(rest) == 1:
            admitted.snapshot = copy.deepcopy(kv)  # the cache already holds the prompt's boundary
        if len(rest) > 1:
            key, self._next_key = self._next_key, self._next_key - 1
            self._prefilling.append(_Prefilling(key, admitted, kv, prompt[:start], rest, sampling))
            self.rows[key] = admitted
        else:
            self.take_over(Joining(admitted, rest, kv, prompt[:start], admitted.job.params.max_tokens, sampling))

    def take_over(self, j: Joining) -> None:
        """A request into the batch, with its KV and the tokens still to run."""
        if self.batch is not None:
            if len(j.segment) > 1:  # a lone request that had not started: its prompt first, by itself
                prefill(self.resident.model, j.kv, j.segment[:-1], self.pace, lambda: None, self.faults,
                        self.resident.kv)
            uid = self.batch.insert(j.segment[-1], j.kv, j.max_tokens, list(j.context) + j.segment[:-1],
                                    j.sampling.sampler, j.sampling.processors,
                                    SampledTarget.of(j.admitted.job.params, self.resident.vocab_size()))
            self.rows[uid] = j.admitted
            return
        from ..cache.batch_kv import rows_for_batch  # MLX: imported after the engine chose its BLAS

        kv = rows_for_batch(j.kv, len(j.segment), j.max_tokens)  # the batch's array sized for its grant
        (uid,) = self.generator.insert_segments([[j.segment]], max_tokens=[j.max_tokens], caches=[kv],
                                                all_tokens=[list(j.context)], samplers=[j.sampling.sampler],
                                                logits_processors=[j.sampling.processors])
        self.rows[uid] = j.admitted

    def _prefill_chunk(self) -> None:
        """One paced chunk of the first joining request's prompt, alone; the
        request joins mlx-lm's batch once only its last token is left."""
        p = self._prefilling[0]
        if not p.looked:
            p.looked = True
            self._borrow_prefix(p)
            if len(p.rest) == 1:
                return self._joined(p)
        chunk = p.rest[:min(self.pace.step(), len(p.rest) - 1)]
        prefill(self.resident.model, p.kv, chunk, self.pace, lambda: None, self.faults, self.resident.kv)
        p.context += chunk
        p.rest = p.rest[len(chunk):]
        if len(p.rest) > 1:
            a = p.admitted
            if a.save_progress is not None and len(p.context) - max(p.saved, a.fetched.start) >= CHECKPOINT_TOKENS:
                a.save_progress(a, p.kv, len(p.context))  # a long prompt's KV to disk as it goes
                p.saved = len(p.context)
            return
        self._joined(p)

    def _borrow_prefix(self, p: _Prefilling) -> None:
        """Agents that share a system prompt join together, before any of
        them is in the prompt cache: a joining row whose prompt starts as a
        decoding row's takes that part of its KV (a device copy) instead of
        prefilling it again (engine/cache/kv_cache.py's copy_prefix)."""
        if self.batch is None:
            return
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
        self._prefilling.pop(0)
        a = self.rows.pop(p.key)
        a.prefilled = (p.kv, len(p.context))
        if a.needs_snapshot:
            a.snapshot = copy.deepcopy(p.kv)  # the cache holds the prompt's boundary now
        self.take_over(Joining(a, p.rest, p.kv, p.context, a.job.params.max_tokens, p.sampling))

    def step(self) -> list[Ended]:
        """One step of the batch: a chunk of the first joining request's
        prompt, then a token for every decoding request. The requests that ended."""
        if self._prefilling:
            self._prefill_chunk()
        ended: list[Ended] = []
        if len(self.rows) > len(self._prefilling):  # rows in mlx-lm's batch
            ended = self._decode_step()
        for uid, a in list(self.rows.items()):  # gone before their first token: cancelled in prefill
            if a.job.cancelled.is_set() and a.first_token_at is None:
                ended.append(self._remove(uid, "cancelled"))
        return ended

    def _decode_step(self) -> list[Ended]:
        """A token for every row in mlx-lm's batch. Rows join it with their
        last prompt token only (`_prefill_chunk`), so its own prefill never
        runs: a joining row's one token goes straight to decoding."""
        began = time.perf_counter()
        if self.batch is not None:
            joined, responses = [], self.batch.next()
        else:
            joined, responses = self.generator.next()
        if log.isEnabledFor(logging.DEBUG):  # where a batch's time goes
            log.debug("batch step %.1f ms: %d rows joined, %d tokens decoded, %d rows in the batch",
                      1000 * (time.perf_counter() - began), len(joined), len(responses), len(self.rows))
        ended: list[Ended] = []
        for r in responses:
            a = self.rows.get(r.uid)
            if a is None:
                continue
            finish = a.feed(r.token, None, r.finish_reason)
            if r.finish_reason is not None:  # mlx-lm ended it (and took it out of the batch)
                del self.rows[r.uid]
                ended.append(Ended(a, finish or r.finish_reason, r.prompt_cache, getattr(r, "speculation", None)))
            elif finish is not None:
                ended.append(self._remove(r.uid, finish))
        return ended

    def _remove(self, uid: int, finish: str) -> Ended:
        a = self.rows.pop(uid)
        if uid < 0:  # still prefilling: nothing of it in mlx-lm's batch, nothing partial kept
            self._prefilling = [p for p in self._prefilling if p.key != uid]
            return Ended(a, finish, None)
        if self.batch is not None:
            speculation = self.batch.spec_stats(uid)
            return Ended(a, finish, self.batch.remove(uid), speculation)
        caches = self.generator.remove([uid], return_prompt_caches=True)
        kv, _ = caches.get(uid, (None, []))
        return Ended(a, finish, kv)
