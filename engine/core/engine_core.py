"""The engine's core: one step loop, in the shape of vLLM's EngineCore.

`EngineCore` has no thread of its own: the worker thread (engine/core/worker.py)
calls `step()` until it stops. It owns the request table, the memory ledger,
the prompt cache (a request's turn through it: prompt_turns.py) and a runner
(engine/model/runner.py: the resident model, its two decoders, every MLX
call). Each step asks the pure scheduler (scheduler.py) what to do — TAKE or
WAIT (the queue's next request, prepared; the idle work), ADMIT (into the
running batch), ALONE (decoded by itself once the batch has drained), DECODE
(a token for every running request; those that ended answered, their KV to
the prompt cache) — makes one runner call, updates the table and publishes
one snapshot (`WorkerStatus`): the phase, the in-flight ids and record, the
counts, /health, /metrics and the drain are views of it. Between two steps an
embedding request's group of forwards may run (embedding_turn.py); an
answer's end waits for its prompt on disk in held_answers.py, idle unload in
keep_alive.py, the crash journal's in-flight record in inflight_record.py.

An exception out of MLX is fatal by design: every request held gets a 500
and `on_fatal` (the engine's Lifecycle) exits with exit_codes.MLX_ERROR, so
the supervisor restarts the engine clean rather than let it limp on; a
backend's capability limit is the one exception (backend_limit.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from mlxd.reports import PromptCacheReport

from .admission import AdmissionQueue
from .backend_limit import serve_on_after_limit
from .embedding_queue import EmbeddingQueue
from .embedding_turn import EmbeddingTurn, mlx_fault
from .held_answers import POLL_S, HeldAnswers
from ..model.decoder_rows import Admitted, Ended
from .device_memory import DeviceMemoryWatch
from ..model.errors import EngineError
from ..model.events import Failed, Started
from ..model.faults import FaultInjector
from ..model.job import Job
from .inflight_record import InflightRecord
from .keep_alive import NEVER, IdleUnload
from .memory_ledger import MemoryLedger
from ..model.model_registry import ModelRegistry
from ..cache.prompt_cache import PromptCache
from ..model.prefill import cancelled_error
from ..cache.prompt_cache_policy import NOT_CACHED
from .prompt_turns import PromptTurns
from .residency import Residency
from .request_table import RequestStatus, RequestTable, running
from ..model.runner import ModelRunner, Prompt
from .scheduler import Pending, Row, Step, next_step, row_of
from ..model.mlx_memory import MemorySnapshot
from .worker_state import Phase, WorkerStatus

log = logging.getLogger("mlxd.engine.core.worker")

HEARTBEAT_S = 0.05  # progress is published at most this often
MEMORY_SAMPLE_S = 0.5  # MLX's memory figures are taken at most this often while requests run (three C calls)
WAIT_S = 0.25  # the longest a step waits on an empty queue (the idle work runs between)


class _Gone(Exception):
    """The client left before its request was served."""


@dataclass(frozen=True)
class Prepared:
    """A request taken from the queue, not admitted yet: tokenized if it may join the batch (else when alone)."""

    job: Job
    prompt: Prompt | None
    view: Pending  # what the scheduler sees of it
    taken_at: float = field(default_factory=time.monotonic)


class EngineCore:
    def __init__(self, registry: ModelRegistry, admission: AdmissionQueue[Job], faults: FaultInjector, runner: ModelRunner,
                 on_fatal: Callable[[BaseException, Job | None], None], inflight_path: Path | None = None,
                 prefill_step_size: int = 512, keep_alive_s: float = NEVER,
                 embeddings: EmbeddingQueue | None = None) -> None:
        self.registry = registry
        self.admission = admission
        self.embeddings = embeddings
        self.faults = faults
        self.runner = runner
        self.on_fatal = on_fatal
        self.inflight = InflightRecord(inflight_path)  # the running requests for the crash listener, written behind
        faults.before_crash = self.inflight.flush
        self.table = RequestTable()
        self.ledger = MemoryLedger(registry.budget_bytes)
        self.prompt_cache = PromptCache(False, None, 0.0)  # the worker gives it the real one on its thread
        self.residency = Residency(self)  # the resident model, its load and unload, MLX's memory figures
        self.turns = PromptTurns(runner, self.prompt_cache)  # a request's turn through it
        self.held = HeldAnswers(lambda: self.prompt_cache, self.runner.finish)  # ends held for their prompt on disk
        self.pending: Prepared | None = None
        self._decoding_published = 0  # rows published as decoding (the table changes when a row's first token comes)
        self.stopped = False  # an MLX fault: the loop ends
        # Published for other threads (immutable, replaced whole).
        self.status = WorkerStatus(Phase.STARTING, None)
        self.memory = MemorySnapshot()
        self.max_observed_concurrency = 0
        self.mlx_memory_limit: int | None = None
        self.device_memory: DeviceMemoryWatch | None = None
        self.active_before_first_load: int | None = None
        self.active_after_last_unload: int | None = None
        self.timings: dict[str, float] = {}  # last_load_s, last_unload_s: for benchmarks and status
        self.idle_unload = IdleUnload(keep_alive_s)  # the resident model given back with nothing to do
        # Running requests' tokens already in counters["generated_tokens"] (id -> count): the tok/s read is live.
        self._counted_tokens: dict[str, int] = {}
        self.counters = {"model_loads": 0, "model_unloads": 0, "idle_unloads": 0, "generated_tokens": 0,
                         "prompt_tokens": 0, "jobs": 0, "spec_requests": 0, "spec_proposed": 0, "spec_accepted": 0,
                         "spec_forwards": 0, "spec_tokens": 0, "embedding_requests": 0, "embedding_inputs": 0,
                         "embedding_tokens": 0, "rerank_requests": 0, "rerank_documents": 0, "rerank_tokens": 0}
        self.embedding_turn = EmbeddingTurn(embeddings, runner, self.counters, self.heartbeat, self.idle_unload.served,
                                            self.fatal, lambda model_id: self.residency.ensure(model_id))

    @property
    def embedding(self) -> Any:
        """The embedding request under way (engine/core/embedding_turn.py), or None."""
        return self.embedding_turn.under_way

    def use_prompt_cache(self, cache: PromptCache) -> None:
        self.prompt_cache = self.turns.cache = cache
        cache.room = self.ledger.cache_room  # the cache keeps within what the ledger leaves it
        if cache.files is not None:
            self.runner.save_progress = self.turns.save_progress  # long prompts' KV to disk as they are prefilled

    # --- the step loop ----------------------------------------------------------
    def step(self) -> None:
        """First the answers' ends held that may go (held_answers.py); then one decision of the scheduler,
        done, or between two of them a group of an embedding request's forwards."""
        if self.held:
            self.held.step(wait=self._chat_work() and not self.runner.rows)
        if self.embedding_turn.take(self._chat_work()):
            return
        pending = self.pending
        if pending is not None and pending.job.cancelled.is_set():  # its client left, it waited too long, a drain
            self.pending = None
            pending.job.channel.put(Failed(cancelled_error()))  # a handler still waiting is told (a drain's)
            self.let_go(pending.job, time.monotonic() - pending.taken_at)
            return
        decision = next_step(pending.view if pending else None, self.admission.has_waiting(), self._rows(),
                             self.slots(), self.ledger.memory)
        if decision is Step.TAKE or decision is Step.WAIT:
            job = self.admission.take(timeout=0 if decision is Step.TAKE else POLL_S if self.held else WAIT_S)
            if job is not None:
                self.pending = self._prepare(job)
            elif decision is Step.WAIT and not self.held:
                self.idle()
        elif decision is Step.ADMIT or decision is Step.ALONE:
            self.pending = None
            self._admit(pending, alone=decision is Step.ALONE)
        else:
            self._decode()

    def slots(self) -> int:
        """Requests decoded at once: the resident model's plan (engine/model/serving_plan.py)."""
        plan = self.runner.plan
        return plan.max_concurrency if plan is not None else self.admission.slots

    def _rows(self) -> list[Row]:
        return [row_of(a) for a in self.runner.rows]

    def idle(self) -> None:
        if self.faults.enabled:
            self.faults.refresh()
            self.faults.check("idle")
        busy = self._chat_work() or self.embedding is not None
        resident = self.runner.resident_id is not None or self.runner.encoder is not None
        if self.idle_unload.due(resident, busy):
            self.idle_unload.unload(self)
        self.prompt_cache.idle()
        if time.monotonic() - self.memory.taken_at > 1.0:
            self.residency.sample_memory()

    # --- a request in ----------------------------------------------------------------
    def _may_batch(self, job: Job) -> bool:
        return (self.slots() > 1 and self.registry.max_concurrency(job.model_id) > 1 and job.params.seed is None
                and not job.images and not job.alone)

    def _prepare(self, job: Job) -> Prepared | None:
        """Held while it waits; tokenized and sized when it may join the
        batch; None when it was refused (400) or its client is gone."""
        started = time.monotonic()
        self.table.hold(job, RequestStatus.WAITING)
        self.publish()
        try:
            if job.cancelled.is_set():
                raise _Gone()
            if self._may_batch(job) and not self.runner.rows:  # nothing running: its model may be made resident
                self.faults.refresh()
                self.residency.ensure(job.model_id)
                self.publish(Phase.IDLE)
            if not self.runner.can_batch(job):
                return Prepared(job, None, Pending(False))
            prompt = self.runner.tokenize(job)
            tokens = len(prompt.tokens)
            self.ledger.check_alone(tokens + job.params.max_tokens)  # the 400 for one that cannot fit even alone
            return Prepared(job, prompt, Pending(True, Row(tokens, job.params.max_tokens)))
        except _Gone:
            job.channel.put(Failed(cancelled_error()))
        except EngineError as exc:
            job.channel.put(Failed(exc))
        except BaseException as exc:  # noqa: BLE001 - a load that failed inside MLX
            self.fatal(exc, job)
            return None
        self.let_go(job, time.monotonic() - started)
        return None

    def _admit(self, p: Prepared, alone: bool) -> None:
        """Into a decoder with its cached prefix: decoded alone (`alone`), or
        into the batch. The prompt cache keeps only what the ledger leaves."""
        job = p.job
        alone = alone or self.slots() <= 1  # max_concurrency = 1: every request is decoded alone
        # On record before anything of it runs: a request that crashes the engine at
        # its start, its load or its prefill is named in the crash journal (quarantine).
        self.table.hold(job, RequestStatus.PREFILLING)
        self.publish()
        self.record_inflight()
        try:
            self.faults.refresh()
            self.faults.check("start", request_text=job.text)
            if alone:
                self.residency.ensure(job.model_id)
                self.publish(Phase.PREFILL)
            if job.alone and self.slots() > 1:
                log.info("request %s was in flight at a crash with others: decoded alone", job.id)
            prompt = self.runner.tokenize(job) if p.prompt is None else p.prompt
            self.heartbeat()  # tokenizing a long prompt is progress, not a hang
            job.channel.put(Started(len(prompt.tokens), prompt.truncation))
            tokens = len(prompt.tokens)
            if alone:  # its KV a grant of its own; a batch row's is counted with the batch's
                self.ledger.grant_alone(job.id, tokens + job.params.max_tokens, prompt.image_tokens)
            else:
                self.ledger.hold_rows([*map(row_of, self.runner.batch_rows), Row(tokens, job.params.max_tokens)])
            fetched = NOT_CACHED
            if self.runner.plan.prompt_cache:
                # Its answer's room allocated with it (a row's KV is allocated once, engine/cache/kv_cache.py).
                fetched = self.turns.fetch(job, prompt.tokens, job.params.max_tokens, self.ledger.request_bytes(tokens))
            self.runner.admit(job, prompt, fetched, self.prompt_cache.enabled, alone, p.taken_at)
        except EngineError as exc:
            job.channel.put(Failed(exc))
            self.ledger.release(job.id)
            self.sync_ledger()
            self.let_go(job, time.monotonic() - p.taken_at)
            self.record_inflight()
            return
        except BaseException as exc:  # noqa: BLE001 - an MLX fault: do not limp on (a backend limit: reload)
            self._forward_failed(exc, job)
            return
        self.counters["jobs"] += 1
        self.sync_ledger()
        self._publish_rows()

    def _chat_work(self) -> bool:
        """A chat request taken, running or waiting."""
        return self.pending is not None or bool(self.runner.rows) or self.admission.has_waiting()

    # --- decoding -------------------------------------------------------------------
    def _decode(self) -> None:
        try:
            ended = self.runner.step()
        except BaseException as exc:  # noqa: BLE001 - an MLX fault mid-step: every request is told
            self._forward_failed(exc)
            return
        self.heartbeat()
        self._count_tokens(self.runner.rows)
        if time.monotonic() - self.memory.taken_at > MEMORY_SAMPLE_S:  # /health's memory while requests run
            self.residency.sample_memory()
        for e in ended:  # every answer's end goes out before any row's KV is stored (a copy, maybe an eviction)
            self._finish(e)
        for e in ended:
            self._end(e)
        self.turns.checkpoint(self.runner.rows)
        if ended:
            self.sync_ledger()
            self._publish_rows()
            self.record_inflight()
            self.residency.sample_memory()
        elif sum(1 for a in self.runner.rows if a.first_token_at is not None) != self._decoding_published:
            self._publish_rows()  # a row has its first token: decoding now (nothing else changes between ends)

    def _count_tokens(self, rows: list[Admitted]) -> None:
        """The rows' tokens generated since they were last counted, into counters["generated_tokens"]."""
        for a in rows:
            done = len(a.generation.tokens)
            self.counters["generated_tokens"] += done - self._counted_tokens.get(a.job.id, 0)
            self._counted_tokens[a.job.id] = done

    def _finish(self, e: Ended) -> None:
        """A request ended: its answer's end, to its client. Counted before the
        last event: a client that reads /metrics right after sees its tokens."""
        a = e.admitted
        self._count_tokens([a])  # its last tokens (_let_go forgets it)
        self.counters["prompt_tokens"] += len(a.prompt)
        spec = e.speculation
        if spec is not None:  # decoded speculatively (engine/model/speculative.py, draft_model.py)
            for key, value in (("spec_requests", 1), ("spec_proposed", spec.proposed), ("spec_accepted", spec.accepted),
                               ("spec_forwards", spec.forwards), ("spec_tokens", spec.tokens)):
                self.counters[key] += value
            log.info("request %s: %s: %d of %d proposed tokens accepted, %d tokens in %d forwards (%.2f a "
                     "forward)", a.job.id, spec.mode.replace("_", " "), spec.accepted, spec.proposed, spec.tokens,
                     spec.forwards, spec.tokens_per_forward)
        self.held.end(e, self.turns.take_checkpoint(a))  # held until its prompt is on disk (held_answers.py)

    def _end(self, e: Ended) -> None:
        """After its answer's end: its memory back to the ledger, its KV to
        the prompt cache, its place freed; the model's idle time starts again."""
        a = e.admitted
        self.idle_unload.served(a.job.keep_alive_s)
        self.ledger.release(a.job.id)
        self.sync_ledger()
        if self.runner.plan is not None and self.runner.plan.prompt_cache:
            self.turns.store(a, e.kv)
        self.let_go(a.job, time.monotonic() - a.taken_at)
        if log.isEnabledFor(logging.DEBUG):  # where a request's time went, for the queue's dead time
            moments = [("admitted", a.admitted_at), ("joined", a.joined_at), ("first_token", a.first_token_at),
                       ("done", time.monotonic())]
            log.debug("request %s (%s): %s", a.job.id, "alone" if a.alone else "batched",
                      " ".join(f"{k} {1000 * (t - a.taken_at):.1f} ms" for k, t in moments if t is not None))

    def sync_ledger(self) -> None:
        """The ledger's view of who holds KV: the batch's rows, and grants only
        for requests still decoded alone (one that joined the batch is a row now)."""
        alone = {a.job.id for a in self.runner.rows} - {a.job.id for a in self.runner.batch_rows}
        self.ledger.keep_alone(alone)
        self.ledger.hold_rows([row_of(a) for a in self.runner.batch_rows])

    # --- publishing --------------------------------------------------------------------
    def publish(self, phase: Phase | None = None) -> None:
        """One snapshot for other threads: the phase and the request table's
        rows. `phase` None: from the requests held (decoding once any has its
        first token, prefilling while any runs, else idle)."""
        requests = self.table.rows()
        if phase is None:
            statuses = {r.status for r in requests}
            phase = (Phase.DECODE if RequestStatus.DECODING in statuses else
                     Phase.PREFILL if RequestStatus.PREFILLING in statuses else Phase.IDLE)
        s, resident = self.status, self.runner.resident_id
        if s.phase is not phase or s.requests != requests or s.resident_model != resident:
            self.status = WorkerStatus(phase, resident, requests)
        self.max_observed_concurrency = max(self.max_observed_concurrency, len(self.status.running))

    def _publish_rows(self) -> None:
        """The decoders' rows in the request table (decoding once a row has its first token), published."""
        rows = self.runner.rows
        for a in rows:
            self.table.hold(a.job, RequestStatus.DECODING if a.first_token_at is not None else RequestStatus.PREFILLING)
        self._decoding_published = sum(1 for a in rows if a.first_token_at is not None)
        self.publish()

    def heartbeat(self, *_: Any) -> None:
        s = self.status
        now = time.monotonic()
        if now - s.last_progress < HEARTBEAT_S:
            return
        self.status = replace(s, last_progress=now)

    def cache_stats(self) -> PromptCacheReport:
        """The prompt cache's latest published figures (any thread)."""
        return self.prompt_cache.stats

    def let_go(self, job: Job, held_s: float) -> None:
        """A request the core holds no more (answered, refused, or gone): out
        of the request table, published, its place in admission freed."""
        self._counted_tokens.pop(job.id, None)
        self.table.release(job)
        self.publish()
        self.admission.done(job, held_s)

    def record_inflight(self) -> None:
        """The requests running (prefilling or decoding), oldest first, to the in-flight record's writer."""
        self.inflight.note([r.job for r in running(self.table.rows())], self.memory)

    def _forward_failed(self, exc: BaseException, culprit: Job | None = None) -> None:
        """A forward raised: a backend's capability limit is served on (engine/core/backend_limit.py);
        anything else is an MLX fault."""
        if not serve_on_after_limit(self, exc, culprit):
            self.fatal(exc, culprit)

    def fatal(self, exc: BaseException, culprit: Job | None = None) -> None:
        """An MLX fault: every request held (one waiting for the batch too) gets an explicit error (an answer
        complete but for its end, that end), and the engine exits for the supervisor to restart it.
        `culprit`: the request being started when it happened, else the oldest running one is named."""
        self.publish(Phase.FAILED)
        error = mlx_fault(exc)
        held = self.table.rows()
        for r in held:
            r.job.channel.put(Failed(error))
        self.held.send_all()  # once their prompt is on disk (bounded)
        self.embedding_turn.fail(error)
        self.stopped = True
        self.inflight.flush()  # the record the listener blames, on disk before the exit
        self.on_fatal(exc, culprit or next((r.job for r in running(held)), None))
