"""The worker's turns when it may generate several requests at once
(`max_concurrency` > 1): what engine/scheduler.py decides, done.

A part of ModelWorker (mixed in), kept apart so that worker.py reads as the
thread, its model cache and one request served alone; the state it touches
is the worker's (the batch, the request waiting to join, the prompt cache),
owned by the worker thread alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .batch import Admitted, BatchRun, Ended
from .errors import EngineError
from .events import Failed, Started
from .generation import Generation, tokenize
from .jobs import Job
from .scheduler import Memory, Pending, Row, Step, cache_room, next_step
from .request_table import RequestStatus
from .worker_state import Phase

if TYPE_CHECKING:
    from .worker import ModelWorker

log = logging.getLogger("mlxd.engine.worker")


MEMORY_SAMPLE_S = 0.5  # MLX's memory figures are taken at most this often while the batch runs (three C calls)


class _Gone(Exception):
    """The client left before its request was served."""


@dataclass(frozen=True)
class Prepared:
    """A request taken from the queue for the batch, tokenized (unless it is
    to be served alone) but not admitted yet."""

    job: Job
    tokens: list[int] | None
    view: Pending  # what the scheduler sees of it
    taken_at: float = field(default_factory=time.monotonic)


class BatchedTurns:
    """ModelWorker's batched loop (see the module's docstring)."""

    def _slots(self: "ModelWorker") -> int:
        if self._resident is None:
            return self.admission.slots
        return self.registry.max_concurrency(self._resident.model_id)

    def _rows(self: "ModelWorker") -> list[Row]:
        return [a.row for a in self._batch.rows.values()] if self._batch is not None else []

    def _batch_turn(self: "ModelWorker") -> None:
        """One turn of the batched loop: what engine/scheduler.py decides."""
        pending = self._pending
        if pending is not None and pending.job.cancelled.is_set():  # its client left, or it waited too long
            self._pending = None
            self._let_go(pending.job, time.monotonic() - pending.taken_at)
            return
        step = next_step(pending.view if pending else None, self.admission.has_waiting(), self._rows(),
                         self._slots(), self._batch_memory or Memory(0, None, 0))
        if step is Step.TAKE or step is Step.WAIT:
            job = self.admission.take(timeout=0 if step is Step.TAKE else 0.25)
            if job is not None:
                self._pending = self._prepare(job)
            elif step is Step.WAIT:
                self._idle_tick()
        elif step is Step.ADMIT:
            self._pending = None
            self._admit(pending)
        elif step is Step.ALONE:
            self._pending = None
            self._serve(pending.job)
        else:
            self._batch_step()

    def _can_batch(self: "ModelWorker", job: Job) -> bool:
        """What mlx-lm's batch can take: the resident text model (when it can be
        batched) with no seed and no image; the rest is served alone."""
        r = self._resident
        return (r is not None and r.model_id == job.model_id and self._mergeable and self._slots() > 1
                and job.params.seed is None and not job.images)

    def _prepare(self: "ModelWorker", job: Job) -> Prepared | None:
        """Tokenize and size a request; None when it was refused (400) or its client is gone."""
        started = time.monotonic()
        self.table.hold(job, RequestStatus.WAITING)
        try:
            if job.cancelled.is_set():
                raise _Gone()
            if not self._batch:  # nothing running: its model may be made resident now
                self.faults.refresh()
                self._ensure_model(job.model_id)
                self._publish(Phase.IDLE)
            if not self._can_batch(job):
                return Prepared(job, None, Pending(False))
            tokens = tokenize(self._resident, job, self.max_prompt_tokens)
            self._room_beside(job, tokens)  # the 400 for a request that cannot fit even alone
            return Prepared(job, tokens, Pending(True, Row(len(tokens), job.params.max_tokens)))
        except _Gone:
            pass
        except EngineError as exc:
            job.channel.put(Failed(exc))
        except BaseException as exc:  # noqa: BLE001 - a load that failed inside MLX
            self._fatal(exc, [job])
            return None
        self._let_go(job, time.monotonic() - started)
        return None

    def _admit(self: "ModelWorker", p: Prepared) -> None:
        """Into the batch, with its cached prefix; the prompt cache keeps only
        what the running requests leave of the budget."""
        job, tokens = p.job, p.tokens
        assert tokens is not None and p.view.row is not None
        # On record before anything of it runs: a request that crashes the engine at
        # its start or in its prefill is named in the crash journal (quarantine).
        self.table.hold(job, RequestStatus.PREFILLING)
        self._record_inflight()
        try:
            self.faults.refresh()
            self.faults.check("start", request_text=job.text)
            job.channel.put(Started(len(tokens)))
            cache = self.prompt_cache
            room = cache_room(self._batch_memory, [*self._rows(), p.view.row], cache.stats.memory_bytes)
            fetched, kv, needs_snapshot = self._cached_start(job, tokens, room)
            generation = Generation(self._resident, job, self.faults, self.pace, self._heartbeat,
                                    on_decode=lambda: None)
            if self._batch is None:
                self._batch = BatchRun(self._resident, self._slots(), self.pace)
            self._batch.admit(Admitted(job, generation, tokens, fetched, self._resident.tokenizer.detokenizer,
                                       needs_snapshot, taken_at=p.taken_at), kv, self._heartbeat,
                              others_waiting=self.admission.has_waiting())
        except EngineError as exc:
            job.channel.put(Failed(exc))
            self._let_go(job, 0.0)
            self._record_inflight()
            return
        except BaseException as exc:  # noqa: BLE001 - an MLX fault: do not limp on
            self._fatal(exc, [job, *(self._batch.jobs if self._batch else [])])
            return
        self.counters["jobs"] += 1
        self._publish_batch()

    def _batch_step(self: "ModelWorker") -> None:
        batch = self._batch
        assert batch is not None
        try:
            ended = batch.step()
        except BaseException as exc:  # noqa: BLE001 - an MLX fault mid-batch: every request is told
            self._fatal(exc, batch.jobs)
            return
        self._heartbeat()
        if time.monotonic() - self.memory.taken_at > MEMORY_SAMPLE_S:  # /health's memory while the batch runs
            self._sample_memory()
        for e in ended:  # every answer's end goes out before any row's KV is stored (a copy, maybe an eviction)
            self._finish(e)
        for e in ended:
            self._end(e)
        self._publish_batch()
        if ended:
            self._record_inflight()

    def _finish(self: "ModelWorker", e: Ended) -> None:
        """A request left the batch: its answer's end, to its client."""
        a = e.admitted
        self.counters["generated_tokens"] += len(a.generation.tokens)
        self.counters["prompt_tokens"] += len(a.prompt)
        a.generation.end(e.finish, len(a.prompt), len(a.generation.tokens), a.fetched.cached_tokens)

    def _end(self: "ModelWorker", e: Ended) -> None:
        """After its answer's end (_finish): its KV to the prompt cache, its place freed."""
        a = e.admitted
        generated = a.generation.tokens
        self._store_turn(a.job, a.prompt, a.fetched, generated, e.kv, a.snapshot, a.needs_snapshot,
                         a.first_token_at - a.admitted_at if a.first_token_at is not None else None)
        cache = self.prompt_cache
        room = cache_room(self._batch_memory, self._rows(), cache.stats.memory_bytes)
        if room < cache.stats.memory_bytes:
            cache.shrink_to(room)
        self._let_go(a.job, time.monotonic() - a.admitted_at)
        if log.isEnabledFor(logging.DEBUG):  # where a batched request's time went (as lone_turns logs a lone one's)
            moments = [("admitted", a.admitted_at), ("joined", a.joined_at), ("first_token", a.first_token_at),
                       ("done", time.monotonic())]
            log.debug("request %s (batched): %s", a.job.id,
                      " ".join(f"{k} {1000 * (t - a.taken_at):.1f} ms" for k, t in moments if t is not None))

    def _publish_batch(self: "ModelWorker") -> None:
        """The batch's rows in the request table (decoding once a row has its
        first token), and the worker's state published."""
        if self._batch is not None:
            for a in self._batch.rows.values():
                self.table.hold(a.job, RequestStatus.DECODING if a.first_token_at is not None
                                else RequestStatus.PREFILLING)
        self._publish()
