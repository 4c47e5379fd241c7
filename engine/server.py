"""The engine's HTTP shell: FastAPI routes over the model worker.

Handlers validate, resolve the model, refuse heavy models, queue a Job and
relay the worker's events as an OpenAI response or SSE stream. They never
touch MLX. `Engine` owns the process-level state (draining, unhealthy,
fatal exit); the worker owns the model; the AdmissionQueue owns the line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
import traceback
import uuid
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator

import psutil
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import mlxd
from mlxd import exit_codes
from mlxd.config import Config
from mlxd.paths import StatePaths

from .admission import AdmissionQueue
from .errors import EngineError
from .faults import FaultInjector
from .metrics import CONTENT_TYPE, EngineMetrics
from .model_registry import ModelRegistry
from .quarantine import QuarantineList
from .protocol import (SSE_DONE, describe_validation_errors, ChatCompletionRequest, CompletionRequest, ResponseBuilder, SamplingFields, Usage,
                       sse_error)
from .worker import (Delta, Event, EventChannel, Failed, Finished, Job, ModelWorker, Phase, SamplingParams, Started,
                     ToolCalls)

log = logging.getLogger("mlxd.engine")
MAX_CHARS_PER_TOKEN = 64  # generous: tokens of real vocabularies span far fewer characters
POLL_S = 0.25  # how often a waiting handler checks for disconnects and timeouts
LOAD_TIMEOUT_S = 1800.0  # a load (with download) longer than this counts as stuck
FINGERPRINT = "mlxd-" + uuid.uuid4().hex[:8]  # changes with every engine process
PROCESS_STARTED_AT = mlxd.STARTED_AT


class ClientGone(Exception):
    """The client disconnected; nobody is left to answer."""


class Engine:
    """Process-level state and the request flow. Lives on the event loop."""

    def __init__(self, config: Config, registry: ModelRegistry, faults: FaultInjector) -> None:
        self.config = config
        self.limits = config.engine
        self.registry = registry
        # busy_spill: a busy engine answers 429 at once, and the gateway sends
        # the request to Ollama instead of letting it wait here.
        self.admission: AdmissionQueue[Job] = AdmissionQueue(0 if config.gateway.busy_spill else config.engine.max_queue)
        default = config.resolve(config.engine.default_model)
        self.paths = StatePaths(config.home)
        self.paths.run.mkdir(parents=True, exist_ok=True)
        self.quarantine = QuarantineList(self.paths.quarantine)
        self.worker = ModelWorker(registry, self.admission, faults, self._on_fatal_from_worker,
                                  config.engine.max_prompt_tokens, default, self.paths.inflight,
                                  config.engine.prefill_step_size)
        self.metrics = EngineMetrics()
        self.started_at = time.monotonic()
        self.draining = False
        self.unhealthy_reason: str | None = None
        self.exiting_reason: str | None = None  # a fatal error: exiting within seconds
        self.open_requests = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._register_gauges()

    # --- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.worker.start()

    def stop(self, timeout: float) -> None:
        self.worker.stop()
        self.worker.join(timeout)

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work, fail queued jobs fast, give the running
        one `shutdown_grace_s` to finish, then cancel it."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: no new requests; %s running", self.worker.status.in_flight or "none")
        self._fail_waiting(EngineError(503, "the engine is shutting down", code="engine_unavailable", retry_after=5))
        if self.loop is not None:
            self.loop.call_later(self.limits.shutdown_grace_s, self._cancel_running)

    def _cancel_running(self) -> None:
        running = self.worker.current_job
        if running is not None:
            log.info("grace period over: cancelling %s", running.id)
            running.cancelled.set()

    def _fail_waiting(self, error: EngineError) -> None:
        for job in self.admission.close():
            job.channel.put(Failed(error))

    def _on_fatal_from_worker(self, exc: BaseException, job: Job | None) -> None:
        # Worker thread: hand over to the loop thread.
        text = "".join(traceback.format_exception(exc)).rstrip()
        print(f"mlxd-engine: fatal MLX error ({type(exc).__name__}): {exc}", file=sys.stderr, flush=True)
        log.error("fatal error in the model worker (request %s):\n%s", job.id if job else None, text)
        code = exit_codes.PRELOAD_FAILED if isinstance(exc, EngineError) else exit_codes.MLX_ERROR
        if self.loop is None:
            os._exit(code)
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._fatal_exit(str(exc), code)))

    async def _fatal_exit(self, reason: str, code: int) -> None:
        # "exiting", not "unhealthy": the supervisor must let us deliver the
        # failed request's error and exit with our code, not kill us as hung.
        self.exiting_reason = f"fatal: {reason}"
        self._fail_waiting(EngineError(503, "the engine hit an MLX error and is restarting", code="engine_restarting",
                                       retry_after=5))
        deadline = time.monotonic() + 3.0
        while self.open_requests > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # let the failed request's answer reach its client
        logging.shutdown()
        os._exit(code)

    # --- health ------------------------------------------------------------
    def stuck_reason(self) -> str | None:
        s = self.worker.status
        now = time.monotonic()
        if s.phase in (Phase.PREFILL, Phase.DECODE) and now - s.last_progress > self.limits.stuck_grace_s:
            return f"worker made no progress on {s.in_flight} for {now - s.last_progress:.0f}s"
        if s.phase is Phase.LOADING and now - s.since > LOAD_TIMEOUT_S:
            return f"model load running for {now - s.since:.0f}s"
        return None

    def health(self) -> tuple[int, dict]:
        s = self.worker.status
        mem = self.worker.memory
        queue = self.admission.snapshot()
        stuck = self.stuck_reason()
        if not self.worker.is_alive() and s.phase is not Phase.STOPPED:
            status, reason = "unhealthy", "the model worker thread is not running"
        elif self.exiting_reason:
            status, reason = "exiting", self.exiting_reason
        elif self.unhealthy_reason or stuck:
            status, reason = "unhealthy", self.unhealthy_reason or stuck
        elif self.draining:
            status, reason = "draining", "shutting down"
        elif not self.worker.ready.is_set():
            status, reason = "loading", "preloading the default model"
        else:
            status, reason = "ok", None
        body = {
            "status": status,
            "reason": reason,
            "worker_alive": self.worker.is_alive(),
            "phase": s.phase.value,
            "resident_model": s.resident_model,
            "in_flight": s.in_flight,
            "in_flight_fingerprint": s.in_flight_fingerprint,
            "queue_depth": queue["waiting"],
            "queue_capacity": queue["capacity"],
            "max_observed_concurrency": self.worker.max_observed_concurrency,
            "memory": {
                "mlx_active_bytes": mem.active_bytes,
                "mlx_peak_bytes": mem.peak_bytes,
                "mlx_cache_bytes": mem.cache_bytes,
                "rss_bytes": psutil.Process().memory_info().rss,
                "budget_bytes": self.registry.budget_bytes,
                "mlx_active_before_first_load": self.worker.active_before_first_load,
                "mlx_active_after_last_unload": self.worker.active_after_last_unload,
            },
            "counters": dict(self.worker.counters),
            "timings": dict(self.worker.timings),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            # Wall-clock instants, for recovery timing: process spawn -> ready.
            "process_started_at": PROCESS_STARTED_AT,
            "ready_at": self.worker.ready_at,
            "pid": os.getpid(),
        }
        return (200 if status == "ok" else 503), body

    def _register_gauges(self) -> None:
        m, w = self.metrics, self.worker
        m.gauge("mlxd_engine_queue_depth", "Requests waiting for the worker",
                lambda: self.admission.snapshot()["waiting"])
        m.gauge("mlxd_engine_in_flight", "Requests generating now (0 or 1)", lambda: w.active_generations)
        m.gauge("mlxd_engine_max_observed_concurrency", "Most generations ever seen at once",
                lambda: w.max_observed_concurrency)
        m.gauge("mlxd_engine_model_loads", "Models loaded since start", lambda: w.counters["model_loads"])
        m.gauge("mlxd_engine_model_unloads", "Models unloaded since start", lambda: w.counters["model_unloads"])
        m.gauge("mlxd_engine_generated_tokens", "Tokens generated since start", lambda: w.counters["generated_tokens"])
        m.gauge("mlxd_engine_prompt_tokens", "Prompt tokens processed since start", lambda: w.counters["prompt_tokens"])
        m.gauge("mlxd_engine_mlx_active_bytes", "MLX active memory", lambda: w.memory.active_bytes)
        m.gauge("mlxd_engine_mlx_peak_bytes", "MLX peak memory", lambda: w.memory.peak_bytes)
        m.gauge("mlxd_engine_mlx_cache_bytes", "MLX buffer cache", lambda: w.memory.cache_bytes)
        m.gauge("mlxd_engine_rss_bytes", "Engine resident set size", lambda: psutil.Process().memory_info().rss)
        m.gauge("mlxd_engine_healthy", "1 when /health answers 200", lambda: 1 if self.health()[0] == 200 else 0)

    # --- the request flow --------------------------------------------------
    def make_job(self, req: SamplingFields, kind: str) -> Job:
        model_id = self.registry.resolve(req.model)
        messages = tools = prompt = None
        if isinstance(req, ChatCompletionRequest):
            messages, tools = [m.for_template() for m in req.messages], req.tools_for_template()
        else:
            prompt = req.prompt  # type: ignore[attr-defined]
        self._check_prompt_size(messages, tools, prompt)
        self.registry.check_allowed(model_id)
        requested = req.requested_max_tokens() or self.limits.default_max_tokens
        params = SamplingParams(
            max_tokens=min(requested, self.limits.max_tokens_cap),
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
            stop=tuple(req.stop), presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        )
        return Job(id=uuid.uuid4().hex[:12], kind=kind, model_id=model_id, params=params,
                   channel=EventChannel(asyncio.get_running_loop()), deadline_s=self.limits.request_deadline_s,
                   messages=messages, tools=tools, prompt=prompt)

    def _check_prompt_size(self, messages: list[dict] | None, tools: list[dict] | None,
                           prompt: str | list[int] | None) -> None:
        """Refuse a prompt that cannot fit before the worker tokenizes it: no
        token of a real tokenizer spans more than MAX_CHARS_PER_TOKEN
        characters, so a longer text is certainly over the limit (and
        tokenizing megabytes would stall the worker)."""
        if messages is not None:
            # Everything the chat template renders counts: names, tool calls and
            # tool schemas too, not only the content (fuzzing found a huge `name`
            # that stalled the tokenizer long enough to count as a hang).
            chars = len(json.dumps([messages, tools], ensure_ascii=False, default=str))
        else:
            chars = len(prompt) if isinstance(prompt, str) else 0  # token ids: the worker counts them exactly
        limit = self.limits.max_prompt_tokens
        if chars > limit * MAX_CHARS_PER_TOKEN:
            raise EngineError(400, f"the prompt has {chars} characters, certainly over this engine's limit of {limit} "
                                   f"tokens", code="context_length_exceeded", param="messages")

    async def run(self, request: Request, req: SamplingFields, kind: str) -> Response:
        job = self.make_job(req, kind)
        self.quarantine.check(job.fingerprint)
        if self.draining:
            raise EngineError(503, "the engine is shutting down", code="engine_unavailable", retry_after=5)
        refusal = self.admission.offer(job)
        if refusal is not None:
            raise refusal
        self.open_requests += 1
        feed = JobFeed(self, job, request)
        try:
            started = await feed.wait_started()
        except BaseException:
            job.cancelled.set()
            self.admission.withdraw(job)
            self.open_requests -= 1
            raise
        builder = ResponseBuilder(kind, req.model, FINGERPRINT)  # type: ignore[arg-type]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            try:
                # Headers go out with the first token, not before: an engine
                # that dies in prefill (where Metal usually runs out of memory)
                # has then sent nothing, and the gateway can still fall back.
                first = await feed.wait_output()
            except BaseException:
                job.cancelled.set()
                self.open_requests -= 1
                raise
            return StreamingResponse(self._stream(feed, builder, first, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": job.id})
        try:
            return await self._collect(feed, builder)
        finally:
            job.cancelled.set()
            self.open_requests -= 1

    async def _collect(self, feed: "JobFeed", builder: ResponseBuilder) -> Response:
        parts: list[str] = []
        calls: list[dict] = []
        while True:
            for ev in await feed.batch(check_disconnect=True):
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                elif isinstance(ev, ToolCalls):
                    calls.extend(ev.calls)
                elif isinstance(ev, Finished):
                    body = builder.full("".join(parts), ev.finish_reason, Usage(ev.prompt_tokens, ev.completion_tokens),
                                        calls)
                    return JSONResponse(body, headers={"X-Request-Id": feed.job.id})
                elif isinstance(ev, Failed):
                    raise ev.error

    async def _stream(self, feed: "JobFeed", builder: ResponseBuilder, first: list[Event],
                      include_usage: bool) -> AsyncIterator[bytes]:
        job = feed.job
        calls_sent = 0
        pending: list[Event] | None = first
        try:
            yield builder.role_chunk()
            while True:
                out = bytearray()
                done = False
                try:
                    events, pending = (pending, None) if pending is not None else (await feed.batch(False), None)
                except EngineError as err:  # e.g. the worker got stuck mid-stream: say so in the stream
                    self.metrics.rejections.labels(err.code).inc()
                    yield sse_error(err.body())
                    return
                for ev in events:
                    if isinstance(ev, Delta):
                        out += builder.delta_chunk(ev.text)
                    elif isinstance(ev, ToolCalls):
                        out += builder.tool_calls_chunk(ev.calls, calls_sent)
                        calls_sent += len(ev.calls)
                    elif isinstance(ev, Finished):
                        out += builder.finish_chunk(ev.finish_reason)
                        if include_usage:
                            out += builder.usage_chunk(Usage(ev.prompt_tokens, ev.completion_tokens))
                        out += SSE_DONE
                        done = True
                    elif isinstance(ev, Failed):
                        # An explicit error event and no [DONE]: never a silent truncation.
                        self.metrics.rejections.labels(ev.error.code).inc()
                        out += sse_error(ev.error.body())
                        done = True
                if out:
                    yield bytes(out)
                if done:
                    return
        finally:
            job.cancelled.set()  # client gone or stream over: free the worker
            self.open_requests -= 1


class JobFeed:
    """The handler's view of one job's events, with every wait bounded:
    queue timeout, client disconnect and a stuck worker all end it."""

    def __init__(self, engine: Engine, job: Job, request: Request) -> None:
        self.engine = engine
        self.job = job
        self.request = request
        self.pending: deque[Event] = deque()
        self.queued_at = time.monotonic()
        self.first_token_seen = False

    async def wait_started(self) -> Started:
        while True:
            for ev in await self.batch(check_disconnect=True):
                if isinstance(ev, Started):
                    self.engine.metrics.queue_wait.observe(time.monotonic() - self.queued_at)
                    return ev
                if isinstance(ev, Failed):
                    raise ev.error

    async def wait_output(self) -> list[Event]:
        """Events up to the first output (a token, tool call or the end);
        raises the error if the job failed first."""
        while True:
            events = await self.batch(check_disconnect=True)
            for ev in events:
                if isinstance(ev, Failed):
                    raise ev.error
                if isinstance(ev, (Delta, ToolCalls, Finished)):
                    return events

    async def batch(self, check_disconnect: bool) -> list[Event]:
        """Every event available, waiting (in bounded steps) for at least one."""
        while True:
            if self.pending:
                out = list(self.pending)
                self.pending.clear()
                return out
            events = await self.job.channel.get(POLL_S)
            if events:
                if not self.first_token_seen and any(isinstance(e, Delta) for e in events):
                    self.first_token_seen = True
                    self.engine.metrics.ttft.observe(time.monotonic() - self.queued_at)
                if isinstance(events[0], Started) and len(events) > 1:
                    self.pending.extend(events[1:])
                    return events[:1]
                return events
            await self._check(check_disconnect)

    async def _check(self, check_disconnect: bool) -> None:
        eng, job = self.engine, self.job
        if check_disconnect and await self.request.is_disconnected():
            raise ClientGone()
        if eng.admission.position(job) is not None:
            waited = time.monotonic() - self.queued_at
            if waited > eng.limits.queue_timeout_s and eng.admission.withdraw(job):
                raise eng.admission.timeout_error(waited)
            return
        stuck = eng.stuck_reason()
        if stuck and eng.worker.status.in_flight == job.id:
            eng.unhealthy_reason = f"stuck: {stuck}"
            raise EngineError(503, f"the engine stopped making progress ({stuck}); it will be restarted",
                              code="engine_stuck", retry_after=10)


# --- the FastAPI app -----------------------------------------------------------

def error_response(err: EngineError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


class RequestCounter:
    """Counts answers by route and status. A plain ASGI middleware: starlette's
    BaseHTTPMiddleware would hide client disconnects from the handlers."""

    ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, app, metrics: EngineMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [499]  # unless a response starts, the client went away

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope["path"] if scope["path"] in self.ROUTES else "other"
            self.metrics.requests.labels(route, str(status[0])).inc()


def create_app(engine: Engine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, 5.0)

    app = FastAPI(title="mlxd engine", version="0.1.0", lifespan=lifespan)
    app.add_middleware(RequestCounter, metrics=engine.metrics)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        engine.metrics.rejections.labels(exc.code).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # "not supported" is the engine's limit, not the client's mistake: the
        # gateway falls back to Ollama for it (and not for malformed input).
        message, param, code = describe_validation_errors(exc.errors())
        return error_response(EngineError(400, message, code=code, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        status = exc.status_code if 400 <= exc.status_code < 500 else 400
        return error_response(EngineError(status, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error answering %s", request.url.path)
        return error_response(EngineError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await engine.run(request, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await engine.run(request, body, "completion")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": engine.registry.listing()}

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = engine.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    return app
