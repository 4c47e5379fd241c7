"""The model worker: the one thread that owns the model and every MLX call.

It takes jobs from the AdmissionQueue one at a time, makes the job's model
resident (unloading the previous one first), tokenizes, generates with
mlx-lm's stream_generate, and reports through the job's EventChannel. HTTP
handlers never touch MLX; they read the worker's published `status` and
`memory` snapshots (immutable objects, replaced whole).

An exception out of MLX is fatal by design: the request gets a 500, the
engine reports itself unhealthy and exits with exit_codes.MLX_ERROR so the
supervisor restarts it clean (DESIGN.md: the engine does not limp on).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import gc
import os
import hashlib
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mlxd.paths import write_json_atomic

from .admission import AdmissionQueue
from .errors import EngineError, bad_request
from .faults import FaultInjector
from .model_cache import Load, Unload, plan_release, plan_switch
from .model_registry import ModelRegistry
from .stop_matcher import StopMatcher
from .tool_calls import ToolCallSplitter, format_tool_calls

log = logging.getLogger("mlxd.engine.worker")
MAX_BACKLOG = 2048  # events buffered for a slow reader before the worker waits
FLUSH_S = 0.02  # once tokens flow, the handler collects them this often
HEARTBEAT_S = 0.05  # progress is published at most this often


# --- events: worker -> handler --------------------------------------------

@dataclass(frozen=True)
class Started:
    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class ToolCalls:
    calls: list[dict]  # OpenAI-shaped tool calls


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: EngineError


Event = Started | Delta | ToolCalls | Finished | Failed


class EventChannel:
    """Worker thread -> asyncio handler.

    Waking the event loop from the worker costs a GIL handoff that sits on
    the decode's critical path (measured: ~130 us a token on 2 cores, about
    8% of the tiny demo model's decode). So once tokens flow, Deltas do not
    wake the loop: the handler collects them every FLUSH_S. Everything else
    (Started, the first Delta, tool calls, the end, errors) wakes it at once,
    so time to first token and the end of a stream are not delayed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Event] = deque()
        self._signalled = False
        self._streaming = False  # set by the handler once Deltas flow
        self._waiter: asyncio.Future | None = None

    def put(self, event: Event) -> None:  # worker thread
        self._items.append(event)
        if self._signalled or (self._streaming and type(event) is Delta):
            return
        self._signalled = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    @property
    def backlog(self) -> int:
        """Events not yet taken by the handler (a slow client's lag)."""
        return len(self._items)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, timeout: float) -> list[Event]:
        """All events available now, waiting up to `timeout` for the first."""
        deadline = self._loop.time() + timeout
        while True:
            self._signalled = False
            if self._items:
                out = [self._items.popleft() for _ in range(len(self._items))]
                if not self._streaming and any(type(e) is Delta for e in out):
                    self._streaming = True
                return out
            left = deadline - self._loop.time()
            if left <= 0:
                return []
            self._waiter = self._loop.create_future()
            timer = self._loop.call_later(min(left, FLUSH_S) if self._streaming else left, self._wake)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None


# --- jobs ------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


@dataclass(eq=False)
class Job:
    id: str
    kind: str  # "chat" or "completion"
    model_id: str
    params: SamplingParams
    channel: EventChannel
    deadline_s: float
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.monotonic)

    @property
    def text(self) -> str:
        """The request's text, for fault matching."""
        if self.messages is not None:
            return "\n".join(str(m.get("content", "")) for m in self.messages)
        return self.prompt if isinstance(self.prompt, str) else ""

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the request's content (for the crash journal)."""
        body = json.dumps([self.model_id, self.messages, self.tools, self.prompt], sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:16]


# --- published state --------------------------------------------------------

class Phase(enum.Enum):
    STARTING = "starting"  # boot and preload
    IDLE = "idle"
    LOADING = "loading"
    PREFILL = "prefill"
    DECODE = "decode"
    STOPPED = "stopped"
    FAILED = "failed"  # an MLX error: the process is about to exit


@dataclass(frozen=True)
class WorkerStatus:
    phase: Phase
    resident_model: str | None
    in_flight: str | None = None  # request id
    in_flight_fingerprint: str | None = None
    since: float = field(default_factory=time.monotonic)  # phase start
    last_progress: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class MemorySnapshot:
    active_bytes: int = 0
    peak_bytes: int = 0
    cache_bytes: int = 0
    taken_at: float = 0.0


class ModelWorker(threading.Thread):
    def __init__(
        self,
        registry: ModelRegistry,
        admission: AdmissionQueue[Job],
        faults: FaultInjector,
        on_fatal: Callable[[BaseException, Job | None], None],
        max_prompt_tokens: int,
        default_model: str | None,
        inflight_path: Path | None = None,
        prefill_step_size: int = 512,
    ) -> None:
        super().__init__(name="mlxd-model-worker", daemon=True)
        self.prefill_step_size = prefill_step_size
        self.registry = registry
        self.admission = admission
        self.faults = faults
        self.on_fatal = on_fatal
        self.max_prompt_tokens = max_prompt_tokens
        self.default_model = default_model
        # The request in flight, on disk: after a crash the listener reads
        # it to journal (and eventually quarantine) the request.
        self.inflight_path = inflight_path
        self._stop_event = threading.Event()
        # Owned by this thread; other threads read the published snapshots.
        self._model: Any = None
        self._tokenizer: Any = None
        self._resident: str | None = None
        self.current_job: Job | None = None  # read by the drain timer to cancel it
        self.status = WorkerStatus(Phase.STARTING, None)
        self.memory = MemorySnapshot()
        self.preload_error: BaseException | None = None
        self.active_before_first_load: int | None = None
        self.active_after_last_unload: int | None = None
        self.ready = threading.Event()  # preload finished (or was skipped)
        self.ready_at: float | None = None  # wall clock, when ready was set
        self.active_generations = 0
        self.max_observed_concurrency = 0
        self.timings: dict[str, float] = {}  # last_load_s, last_unload_s: for benchmarks and status
        self.counters = {"model_loads": 0, "model_unloads": 0, "generated_tokens": 0, "prompt_tokens": 0,
                         "jobs": 0}

    # --- lifecycle -------------------------------------------------------
    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            if self.inflight_path is not None:
                self.inflight_path.unlink(missing_ok=True)  # the listener has read it by now
            self.faults.refresh()
            self.faults.check("boot")
            self._preload()
            self.ready_at = time.time()
            self.ready.set()
            while not self._stop_event.is_set():
                job = self.admission.take(timeout=0.25)
                if job is None:
                    self._idle_tick()
                    continue
                self._serve(job)
            if self.status.phase is Phase.FAILED:
                return
        except BaseException as exc:  # noqa: BLE001 - anything escaping is fatal
            self._publish(Phase.FAILED)
            self.ready.set()
            self.on_fatal(exc, None)
            return
        self._publish(Phase.STOPPED)

    def _preload(self) -> None:
        self._sample_memory()
        self.active_before_first_load = self.memory.active_bytes
        if not self.default_model:
            self._publish(Phase.IDLE)
            return
        try:
            self.registry.check_allowed(self.default_model)
        except EngineError as refusal:
            log.warning("not preloading %s: %s", self.default_model, refusal.message)
            self._publish(Phase.IDLE)
            return
        try:
            self._ensure_model(self.default_model)
        except EngineError as exc:
            self.preload_error = exc
            raise
        self._publish(Phase.IDLE)

    def _idle_tick(self) -> None:
        if self.faults.enabled:
            self.faults.refresh()
            self.faults.check("idle")
        if time.monotonic() - self.memory.taken_at > 1.0:
            self._sample_memory()

    # --- publishing ------------------------------------------------------
    def _publish(self, phase: Phase, job: Job | None = None) -> None:
        self.status = WorkerStatus(phase, self._resident, job.id if job else None,
                                   job.fingerprint if job else None)

    def _heartbeat(self, *_: Any) -> None:
        s = self.status
        now = time.monotonic()
        if now - s.last_progress < HEARTBEAT_S:
            return
        self.status = WorkerStatus(s.phase, s.resident_model, s.in_flight, s.in_flight_fingerprint, s.since, now)

    def _sample_memory(self) -> None:
        import mlx.core as mx

        self.memory = MemorySnapshot(mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory(),
                                     time.monotonic())

    # --- the model cache -------------------------------------------------
    def _ensure_model(self, model_id: str, job: Job | None = None) -> None:
        for step in plan_switch(self._resident, model_id):
            if isinstance(step, Unload):
                self._unload()
            else:
                self._publish(Phase.LOADING, job)
                self._load(step.model_id)

    def _unload(self) -> None:
        import mlx.core as mx

        started = time.monotonic()
        self._model = None
        self._tokenizer = None
        self._resident = None
        gc.collect()
        mx.clear_cache()
        self.counters["model_unloads"] += 1
        self._sample_memory()
        self.timings["last_unload_s"] = round(time.monotonic() - started, 4)
        self.active_after_last_unload = self.memory.active_bytes
        # Peak memory from here on covers the next model alone: with it a
        # test (and an operator) can see that two models never coexisted.
        mx.reset_peak_memory()

    def _load(self, model_id: str) -> None:
        from mlx_lm.utils import load

        self.registry.check_allowed(model_id)  # re-checked: files may have changed
        self.faults.check("load")
        target = self.registry.load_target(model_id)
        started = time.monotonic()
        log.info("loading model %s from %s", model_id, target)
        try:
            model, tokenizer = load(target)
        except (OSError, ValueError, KeyError, ImportError) as exc:
            # Missing files, unsupported architecture, no network for a
            # download: not an MLX fault; the engine stays up.
            for step in plan_release(self._resident):
                self._unload()
            raise EngineError(503, f"could not load model {model_id!r}: {exc}", code="model_load_failed",
                              param="model", retry_after=30) from exc
        self._model, self._tokenizer, self._resident = model, tokenizer, model_id
        self.counters["model_loads"] += 1
        self._sample_memory()
        self.timings["last_load_s"] = round(time.monotonic() - started, 4)
        log.info("loaded %s in %.1fs (MLX active %.0f MiB)", model_id, time.monotonic() - started,
                 self.memory.active_bytes / 2**20)

    # --- serving one job ---------------------------------------------------
    def _serve(self, job: Job) -> None:
        started = time.monotonic()
        self.counters["jobs"] += 1
        self.current_job = job
        self._record_inflight(job)
        try:
            if job.cancelled.is_set():
                return
            self.faults.refresh()
            self.faults.check("start", request_text=job.text)
            self._ensure_model(job.model_id, job)
            self._publish(Phase.PREFILL, job)
            tokens = self._tokenize(job)
            self._heartbeat()  # tokenizing a long prompt is progress, not a hang
            job.channel.put(Started(len(tokens)))
            self._generate(job, tokens)
        except EngineError as exc:
            job.channel.put(Failed(exc))
        except BaseException as exc:  # noqa: BLE001 - an MLX fault: do not limp on
            self._publish(Phase.FAILED, job)
            job.channel.put(Failed(EngineError(500, f"MLX error: {exc}; the engine is restarting",
                                               code="mlx_error", retry_after=5)))
            self._stop_event.set()
            self.on_fatal(exc, job)
        finally:
            self.current_job = None
            if self.status.phase is not Phase.FAILED:
                self._publish(Phase.IDLE)
                self._record_inflight(None)
            self.admission.done(job, time.monotonic() - started)

    def _record_inflight(self, job: Job | None) -> None:
        if self.inflight_path is None:
            return
        try:
            if job is None:
                self.inflight_path.unlink(missing_ok=True)
            else:
                m = self.memory
                write_json_atomic(self.inflight_path, {
                    "request_id": job.id, "fingerprint": job.fingerprint, "model": job.model_id,
                    "pid": os.getpid(), "started": time.time(),
                    "memory": {"mlx_active_bytes": m.active_bytes, "mlx_peak_bytes": m.peak_bytes,
                               "mlx_cache_bytes": m.cache_bytes}}, durable=False)
        except OSError as exc:  # a full disk must not take requests down
            log.warning("cannot record the in-flight request: %s", exc)

    def _tokenize(self, job: Job) -> list[int]:
        tok = self._tokenizer
        if job.kind == "completion":
            if isinstance(job.prompt, list):
                vocab = self._vocab_size()
                bad = next((t for t in job.prompt if not 0 <= t < vocab), None)
                if bad is not None:
                    raise bad_request(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                      param="prompt")
                tokens = list(job.prompt)
            else:
                tokens = tok.encode(job.prompt)
        elif getattr(tok, "chat_template", None):
            try:
                tokens = tok.apply_chat_template(job.messages, tools=job.tools, add_generation_prompt=True,
                                                 tokenize=True)
            except Exception as exc:  # noqa: BLE001 - templates raise anything; it is the input's fault
                raise bad_request(f"the model's chat template rejected the messages: {exc}", param="messages",
                                  code="invalid_messages") from exc
        else:
            from mlx_lm.server import convert_chat

            tokens = tok.encode(convert_chat(job.messages))
        if not tokens:
            raise bad_request("the prompt is empty", param="prompt")
        if len(tokens) > self.max_prompt_tokens:
            raise EngineError(400, f"the prompt has {len(tokens)} tokens, over this engine's limit of "
                                   f"{self.max_prompt_tokens}", code="context_length_exceeded", param="messages")
        if job.params.logit_bias:
            vocab = self._vocab_size()
            bad = next((t for t in job.params.logit_bias if t >= vocab), None)
            if bad is not None:
                raise bad_request(f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                  param="logit_bias")
        return tokens

    def _vocab_size(self) -> int:
        args = getattr(self._model, "args", None)
        return int(getattr(args, "vocab_size", 0) or len(self._tokenizer.vocab))

    def _emit_tool_calls(self, job: Job, bodies: list[str]) -> bool:
        if not bodies:
            return False
        calls, unparsed = format_tool_calls(bodies, self._tokenizer.tool_parser, job.tools)
        if calls:
            job.channel.put(ToolCalls(calls))
        if unparsed:
            job.channel.put(Delta(unparsed))
        return bool(calls)

    def _wait_for_reader(self, job: Job, deadline: float) -> None:
        """Backpressure: a client that reads slower than we generate makes
        the worker wait (bounded by the deadline) instead of buffering
        without limit."""
        while job.channel.backlog > MAX_BACKLOG // 2 and not job.cancelled.is_set() and time.monotonic() < deadline:
            self._heartbeat()  # waiting on a client is not being stuck
            time.sleep(0.005)

    def _generate(self, job: Job, prompt: list[int]) -> None:
        import mlx.core as mx
        from mlx_lm.generate import stream_generate
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        p = job.params
        if p.seed is not None:
            mx.random.seed(p.seed)
        # top_k at or over the vocabulary means "no top-k": MLX's partition
        # would fail on it, and a request must never take the engine down.
        top_k = p.top_k if 0 < p.top_k < self._vocab_size() else 0
        sampler = make_sampler(temp=p.temperature, top_p=p.top_p if p.top_p < 1.0 else 0.0, min_p=p.min_p,
                               top_k=top_k)
        processors = make_logits_processors(p.logit_bias, p.repetition_penalty, presence_penalty=p.presence_penalty,
                                            frequency_penalty=p.frequency_penalty)
        stops = StopMatcher(list(p.stop))
        tok = self._tokenizer
        splitter = (ToolCallSplitter(tok.tool_call_start, tok.tool_call_end)
                    if job.tools and getattr(tok, "has_tool_calling", False) else None)
        called = False
        deadline = time.monotonic() + job.deadline_s
        token_faults = any(f.point == "token" for f in self.faults.active) and self.faults.applies_to(job.text)
        finish, generated = "length", 0
        self.active_generations += 1
        self.max_observed_concurrency = max(self.max_observed_concurrency, self.active_generations)
        try:
            first = True
            for resp in stream_generate(self._model, self._tokenizer, prompt, max_tokens=p.max_tokens,
                                        sampler=sampler, logits_processors=processors,
                                        prefill_step_size=self.prefill_step_size,
                                        prompt_progress_callback=self._heartbeat):
                if first:
                    self._publish(Phase.DECODE, job)
                    first = False
                else:
                    self._heartbeat()
                generated = resp.generation_tokens
                if token_faults:
                    self.faults.check("token", generated)
                text = stops.feed(resp.text)
                if splitter is not None:
                    text, bodies = splitter.feed(text)
                    called = self._emit_tool_calls(job, bodies) or called
                if text:
                    job.channel.put(Delta(text))
                    if job.channel.backlog > MAX_BACKLOG:
                        self._wait_for_reader(job, deadline)
                if stops.stopped:
                    finish = "stop"
                    break
                if resp.finish_reason is not None:
                    finish = resp.finish_reason
                    break
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                if time.monotonic() > deadline:
                    finish = "length"  # the deadline ends the answer like max_tokens does
                    log.info("request %s hit its %.0fs deadline after %d tokens", job.id, job.deadline_s, generated)
                    break
        finally:
            self.active_generations -= 1
        self.counters["generated_tokens"] += generated
        self.counters["prompt_tokens"] += len(prompt)
        if finish == "cancelled":
            # Client gone, or the drain's grace ran out: never end such an
            # answer as if it were complete.
            job.channel.put(Failed(EngineError(503, "generation cancelled: the engine is shutting down",
                                               code="engine_unavailable", retry_after=5)))
            return
        tail = stops.flush()
        if splitter is not None:
            text, bodies = splitter.feed(tail)
            more, last = splitter.flush()
            tail = text + more
            called = self._emit_tool_calls(job, bodies + last) or called
        if tail:
            job.channel.put(Delta(tail))
        if called and finish == "stop":
            finish = "tool_calls"
        job.channel.put(Finished(finish, len(prompt), generated))
        self._sample_memory()
