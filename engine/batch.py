"""Batched generation (`max_concurrency` > 1): the running requests decoded
as one batch by mlx-lm's BatchGenerator, on the worker thread.

A joining request's prompt is prefilled by itself, a paced chunk a step
(engine/prefill.py, the lone path's prefill), between the batch's decode
steps, and joins mlx-lm's batch with its last token: alone, attention is
MLX's fused causal kernel; in mlx-lm's batch, rows are padded and attention
takes an explicit mask (scores, their softmax and the mask, in float32, over
the whole context): on the H100 (8B) 4 x 12k tokens prefilled at ~24k tokens/s
alone against ~11k in mlx-lm's batch, and a turn of 1.7k tokens over 14k
cached ran at ~1.7k tokens/s in the batch. The decoding rows get a step after
every chunk, so a long prompt joining does not stop their answers. So
mlx-lm's batch only decodes: its own prefill, whose step size it fixes when
it is made (mlxd made it at the pace's first step, 32 tokens: 10x slower
on the H100 until issue 35), never runs.

A request alone is decoded as mlx-lm decodes one (`generate_step`, `_Solo`):
a batch of one costs ~40 % of the decode speed on a GPU (measured: 83 against
139 tok/s on the 8B demo model), and one agent at a time is the common case.
When a second request joins, the lone one moves into the batch where it
stands: its KV (cut back by the token whose forward pass mlx-lm has already
queued) and its last token go in as a one-token prompt, its sampler,
detokenizer and Generation carry on, so its answer goes on as if nothing
happened (greedy answers are the same tokens; tested).

`BatchRun` owns the BatchGenerator and one `Admitted` per request in it. Each
request keeps all it has alone: its sampler and penalties, its Generation
(stop strings, reasoning and tool-call parsing, deadline, cancellation), its
detokenizer. The worker decides who joins (engine/scheduler.py) and owns the
prompt cache; a request's KV comes back to it in `Ended` when it leaves.
A request's KV is allocated at the length admission granted it: alone, its
own cache (engine/kv_cache.py); in the batch, the batch's array, sized when
rows join (engine/batch_kv.py).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .generation import PROMPT_TAIL, Generation, ResidentModel
from .jobs import Job
from .prefill import prefill
from .prefill_pace import PrefillPace
from .prompt_cache import Fetched
from .sampling import make_sampling, seeing_context
from .scheduler import Row, starts_alone

log = logging.getLogger("mlxd.engine.worker")


def batchable_model(model: Any) -> bool:
    """Whether mlx-lm can batch this model: every layer's cache can be merged
    (mlx_lm.server asks the same)."""
    from mlx_lm.models.cache import make_prompt_cache

    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


@dataclass(eq=False)
class Admitted:
    """A request in the batch."""

    job: Job
    generation: Generation
    prompt: list[int]
    fetched: Fetched
    detokenizer: Any
    needs_snapshot: bool  # its KV cannot be cut back: kept at the prompt's boundary for the prompt cache
    taken_at: float = field(default_factory=time.monotonic)  # from the queue
    admitted_at: float = field(default_factory=time.monotonic)
    joined_at: float | None = None  # in the batch (or decoding alone), its cached prefix fetched and prefilled
    snapshot: list[Any] | None = None
    first_token_at: float | None = None

    @property
    def row(self) -> Row:
        generated = len(self.generation.tokens)
        return Row(len(self.prompt) + generated, self.job.params.max_tokens - generated)


@dataclass(eq=False)
class _Solo:
    """The one request decoding alone, through mlx-lm's generate_step."""

    admitted: Admitted
    kv: list[Any]
    steps: Any  # generate_step's generator: (token, logprobs) per step
    context: list[int]  # the tokens its KV holds (the cached part, and what was prefilled at the engine's pace)
    rest: list[int]  # the prompt after them
    sampler: Any
    processors: list[Any]
    yielded: int = 0


SOLO = -1  # the lone request's key among the rows


@dataclass(eq=False)
class _Prefilling:
    """A request whose prompt is being prefilled by itself before it joins the batch."""

    key: int  # its key among the rows until mlx-lm's batch gives it a uid
    admitted: Admitted
    kv: list[Any]
    context: list[int]  # the tokens its KV holds
    rest: list[int]  # the prompt after them; the last joins the batch as a one-token segment
    sampler: Any
    processors: list[Any]


@dataclass(frozen=True)
class Ended:
    """A request that left the batch, with its KV for the prompt cache."""

    admitted: Admitted
    finish: str
    kv: list[Any] | None  # the KV of its prompt and what it generated (all but the last token)


class BatchRun:
    def __init__(self, resident: ResidentModel, slots: int, pace: PrefillPace) -> None:
        from mlx_lm.generate import BatchGenerator

        self.resident = resident
        self.pace = pace  # the size of each prefill chunk a joining row is given, from the speed measured
        eos = sorted(resident.tokenizer.eos_token_ids)
        self.generator = BatchGenerator(resident.model, stop_tokens=[[t] for t in eos],
                                        completion_batch_size=slots, prefill_batch_size=slots)
        self.rows: dict[int, Admitted] = {}
        self._solo: _Solo | None = None
        self._prefilling: list[_Prefilling] = []  # in order of admission; the first is prefilled a chunk a step
        self._next_key = SOLO - 1  # keys of prefilling rows: negative, never a uid of mlx-lm's
        # One sampler object per setting: rows that share it are sampled in one call.
        self._samplers: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def jobs(self) -> list[Job]:
        return [a.job for a in self.rows.values()]

    def close(self) -> None:
        self.generator.close()

    def admit(self, admitted: Admitted, kv: list[Any] | None, heartbeat: Any = None,
              others_waiting: bool = False) -> None:
        """Into the batch: its prompt after the cached part is prefilled by
        itself, a chunk a step (`_prefill_chunk`), then it decodes with the
        rest; alone (`starts_alone`), it decodes as mlx-lm decodes one request."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        from mlxd.memory_estimate import KVLayout

        from .kv_cache import make_kv

        job, prompt, start = admitted.job, admitted.prompt, admitted.fetched.start
        p = job.params
        admitted.generation.waits_for_reader = False
        admitted.generation.begin(prompt[-PROMPT_TAIL:])
        sampler, processors = make_sampling(p, self.resident.vocab_size())
        key = (p.temperature, p.top_p, p.min_p, p.top_k)
        sampler = None if p.temperature == 0 else self._samplers.setdefault(key, sampler)  # None: greedy
        grammar = admitted.generation.grammar  # applied last, after penalties: it needs only the last token
        if grammar is not None:  # its own sampler, tapped for the token it draws (engine/constrained.py)
            from mlx_lm.sample_utils import make_sampler

            sampler = grammar.sampling(sampler or make_sampler(0.0))
        rest = prompt[start:]
        if admitted.needs_snapshot and len(rest) == 1:
            admitted.snapshot = copy.deepcopy(kv)  # the cache already holds the prompt's boundary
        if self._solo is not None:
            self._join(self._solo)
        alone = starts_alone(not self.rows, others_waiting)
        if kv is None:  # alone: allocated once at its admitted length (in the batch, the batch's array is)
            kv = (make_kv(self.resident.model, len(prompt) + p.max_tokens, self.resident.kv) if alone
                  else make_kv(self.resident.model, len(prompt), KVLayout()))  # prefilled alone, then joins
        if alone and can_trim_prompt_cache(kv):
            self._solo = self._start_solo(admitted, kv, rest, sampler, processors, heartbeat)
            self.rows[SOLO] = admitted
        elif len(rest) > 1:
            key, self._next_key = self._next_key, self._next_key - 1
            self._prefilling.append(_Prefilling(key, admitted, kv, prompt[:start], rest, sampler,
                                                processors + ([grammar] if grammar is not None else [])))
            self.rows[key] = admitted
        else:
            self._insert(admitted, [rest], kv, prompt[:start], p.max_tokens, sampler,
                         processors + ([grammar] if grammar is not None else []))
        admitted.joined_at = time.monotonic()

    def _insert(self, admitted: Admitted, segments: list[list[int]], kv: list[Any], context: list[int],
                max_tokens: int, sampler: Any, processors: list[Any]) -> None:
        from .batch_kv import rows_for_batch  # MLX: imported after the engine chose its BLAS

        kv = rows_for_batch(kv, sum(len(s) for s in segments), max_tokens)  # the batch's array sized for its grant
        (uid,) = self.generator.insert_segments([segments], max_tokens=[max_tokens], caches=[kv],
                                                all_tokens=[list(context)], samplers=[sampler],
                                                logits_processors=[processors])
        self.rows[uid] = admitted

    def _start_solo(self, admitted: Admitted, kv: list[Any], rest: list[int], sampler: Any, processors: list[Any],
                    heartbeat: Any) -> _Solo:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        start = admitted.fetched.start
        if len(rest) > 1:  # at the engine's pace, as a lone request (generate_step's one step size was the first
            # step's, 32 tokens, for the whole prompt: 30 steps for 1k tokens, 4x mlx-lm's TTFT on a GPU)
            prefill(self.resident.model, kv, rest[:-1], self.pace, heartbeat or (lambda: None),
                    cancelled=admitted.job.cancelled)
            start, rest = start + len(rest) - 1, rest[-1:]
        context = admitted.prompt[:start]
        seeing = [seeing_context(proc, context) for proc in processors] if processors and context else processors
        grammar = admitted.generation.grammar
        seeing = seeing + ([grammar] if grammar is not None else [])
        steps = generate_step(mx.array(rest, dtype=mx.int32), self.resident.model,
                              max_tokens=admitted.job.params.max_tokens, sampler=sampler or make_sampler(0.0),
                              logits_processors=seeing, prompt_cache=kv,
                              prompt_progress_callback=heartbeat)
        return _Solo(admitted, kv, steps, context, rest, sampler,
                     processors + ([grammar] if grammar is not None else []))

    def _join(self, solo: _Solo) -> None:
        """The lone request moves into the batch, where it stands."""
        from mlx_lm.models.cache import trim_prompt_cache

        self._solo = None
        a = self.rows.pop(SOLO)
        solo.steps.close()
        generated = a.generation.tokens
        if solo.yielded == 0:  # not started: it joins as any request does
            self._insert(a, [solo.rest], solo.kv, solo.context, a.job.params.max_tokens, solo.sampler,
                         solo.processors)
            return
        # mlx-lm has already run the last token through the model: its KV goes,
        # and the token comes back as a one-token prompt (which its grammar has already consumed).
        trim_prompt_cache(solo.kv, 1)
        if a.generation.grammar is not None:
            a.generation.grammar.repeat_last()
        self._insert(a, [generated[-1:]], solo.kv, a.prompt + generated[:-1], a.job.params.max_tokens - solo.yielded,
                     solo.sampler, solo.processors)

    def _prefill_chunk(self) -> None:
        """One paced chunk of the first joining request's prompt, alone; the
        request joins mlx-lm's batch once only its last token is left."""
        p = self._prefilling[0]
        chunk = p.rest[:min(self.pace.step(), len(p.rest) - 1)]
        prefill(self.resident.model, p.kv, chunk, self.pace, lambda: None)
        p.context += chunk
        p.rest = p.rest[len(chunk):]
        if len(p.rest) > 1:
            return
        self._prefilling.pop(0)
        a = self.rows.pop(p.key)
        if a.needs_snapshot:
            a.snapshot = copy.deepcopy(p.kv)  # the cache holds the prompt's boundary now
        self._insert(a, [p.rest], p.kv, p.context, a.job.params.max_tokens, p.sampler, p.processors)

    def step(self) -> list[Ended]:
        """One step of the batch: a chunk of the first joining request's
        prompt, then a token for every decoding request. The requests that ended."""
        if self._solo is not None:
            return self._solo_step(self._solo)
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
        joined, responses = self.generator.next()
        if log.isEnabledFor(logging.DEBUG):  # where a batch's time goes
            log.debug("batch step %.1f ms: %d rows joined, %d tokens decoded, %d rows in the batch",
                      1000 * (time.perf_counter() - began), len(joined), len(responses), len(self.rows))
        ended: list[Ended] = []
        for r in responses:
            a = self.rows.get(r.uid)
            if a is None:
                continue
            finish = self._feed(a, r.token, r.finish_reason)
            if r.finish_reason is not None:  # mlx-lm ended it (and took it out of the batch)
                del self.rows[r.uid]
                ended.append(Ended(a, finish or r.finish_reason, r.prompt_cache))
            elif finish is not None:
                ended.append(self._remove(r.uid, finish))
        return ended

    def _feed(self, a: Admitted, token: int, model_finish: str | None) -> str | None:
        """A token to its request: detokenized (as mlx_lm.server does) and relayed."""
        if a.first_token_at is None:
            a.first_token_at = time.monotonic()
        detok = a.detokenizer
        if model_finish != "stop":
            detok.add_token(token)
        if model_finish is not None:
            detok.finalize()
        return a.generation.feed(detok.last_segment, token, model_finish)

    def _solo_step(self, solo: _Solo) -> list[Ended]:
        a = solo.admitted
        if a.job.cancelled.is_set() and a.first_token_at is None:
            return [self._end_solo(solo, "cancelled")]
        try:
            token, _ = next(solo.steps)
        except StopIteration:
            return [self._end_solo(solo, "length")]
        solo.yielded += 1
        model_finish = ("stop" if token in self.resident.tokenizer.eos_token_ids
                        else "length" if solo.yielded >= a.job.params.max_tokens else None)
        finish = self._feed(a, token, model_finish)
        return [self._end_solo(solo, finish)] if finish is not None else []

    def _end_solo(self, solo: _Solo, finish: str) -> Ended:
        self._solo = None
        self.rows.pop(SOLO)
        solo.steps.close()
        a = solo.admitted
        return Ended(a, finish, solo.kv)

    def _remove(self, uid: int, finish: str) -> Ended:
        a = self.rows.pop(uid)
        if uid < SOLO:  # still prefilling: nothing of it in mlx-lm's batch, nothing partial kept
            self._prefilling = [p for p in self._prefilling if p.key != uid]
            return Ended(a, finish, None)
        caches = self.generator.remove([uid], return_prompt_caches=True)
        kv, _ = caches.get(uid, (None, []))
        return Ended(a, finish, kv)

