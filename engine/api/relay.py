"""The request flow: admit a job, wait for the worker, relay its events as
one OpenAI response or as an SSE stream, in the route's shape (a
`Presenter`: chat and completions by default, or the Responses API's, or
Anthropic's Messages API's).

`RequestRelay` holds no state of its own beyond its collaborators; each
request's waiting lives in its `JobFeed`, whose every wait is bounded.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlxd.config import EngineConfig

from ..core.admission import AdmissionQueue
from ..model.errors import EngineError
from ..model.events import Delta, Event, Failed, Finished, Started, ToolCalls
from .health import Health
from ..model.job import Job
from .request_job import job_from_request
from .lifecycle import Lifecycle
from .metrics import EngineMetrics
from ..model.model_registry import ModelRegistry
from .quarantine import QuarantineList
from .request_schema import SamplingFields
from .response_builder import ChatPresenter, Presenter, ResponseBuilder, Usage
from ..model.context_overflow import TRUNCATED_HEADER

POLL_S = 0.25  # how often a waiting handler checks for disconnects and timeouts
FINGERPRINT = "mlxd-" + uuid.uuid4().hex[:8]  # changes with every engine process


class ClientGone(Exception):
    """The client disconnected; nobody is left to answer."""


class RequestRelay:
    def __init__(self, limits: EngineConfig, registry: ModelRegistry, quarantine: QuarantineList,
                 admission: AdmissionQueue[Job], lifecycle: Lifecycle, health: Health, metrics: EngineMetrics) -> None:
        self.limits = limits
        self.registry = registry
        self.quarantine = quarantine
        self.admission = admission
        self.lifecycle = lifecycle
        self.health = health
        self.metrics = metrics

    async def answer(self, request: Request, req: SamplingFields, kind: str,
                     presenter: Callable[[Started], Presenter] | None = None) -> Response:
        """`presenter` makes the answer's presenter once the job started, from
        its Started event (default: chat or completion chunks, ResponseBuilder's)."""
        job = job_from_request(req, kind, self.registry, self.limits)
        self.quarantine.check(job.fingerprint)
        job.alone = self.quarantine.suspect(job.fingerprint)  # a retry alone clears it or is the evidence
        if self.lifecycle.draining:
            raise EngineError(503, "the engine is shutting down", code="engine_unavailable", retry_after=5)
        refusal = self.admission.offer(job)
        if refusal is not None:
            raise refusal
        self.lifecycle.request_opened()
        feed = JobFeed(job, request, self.admission, self.limits.queue_timeout_s, self.health, self.metrics)
        try:
            started = await feed.wait_started()
        except BaseException:
            job.cancelled.set()
            self.admission.withdraw(job)
            self.lifecycle.request_closed()
            raise
        if presenter is not None:
            builder = presenter(started)
        else:
            builder = ChatPresenter(ResponseBuilder(kind, req.model, FINGERPRINT),  # type: ignore[arg-type]
                                    bool(req.stream_options and req.stream_options.include_usage))
        if req.stream:
            try:
                # Headers go out with the first token, not before: an engine
                # that dies in prefill (where Metal usually runs out of memory)
                # has then sent nothing, and the gateway can still fall back.
                first = await feed.wait_output()
            except BaseException:
                job.cancelled.set()
                self.lifecycle.request_closed()
                raise
            return RelayedStream(self._stream(feed, builder, first), self._closer(job),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **feed.headers()})
        try:
            return await self._collect(feed, builder)
        finally:
            job.cancelled.set()
            self.lifecycle.request_closed()

    async def _collect(self, feed: JobFeed, builder: Presenter) -> Response:
        parts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        while True:
            for ev in await feed.batch(check_disconnect=True):
                if isinstance(ev, Delta):
                    (reasoning if ev.reasoning else parts).append(ev.text)
                elif isinstance(ev, ToolCalls):
                    calls.extend(ev.calls)
                elif isinstance(ev, Finished):
                    body = builder.full("".join(parts), ev.finish_reason, feed.usage(ev), calls, "".join(reasoning),
                                        ev.stop_sequence)
                    return JSONResponse(body, headers=feed.headers())
                elif isinstance(ev, Failed):
                    raise ev.error

    async def _stream(self, feed: JobFeed, builder: Presenter, first: list[Event]) -> AsyncIterator[bytes]:
        """The SSE body; its cleanup is RelayedStream's, however the stream ends."""
        pending: list[Event] | None = first
        yield builder.opening()
        while True:
            out = bytearray()
            done = False
            try:
                events, pending = (pending, None) if pending is not None else (await feed.batch(False), None)
            except EngineError as err:  # e.g. the worker got stuck mid-stream: say so in the stream
                self.metrics.rejections.labels(err.code).inc()
                yield builder.failed(err)
                return
            for ev in events:
                if isinstance(ev, Delta):
                    out += builder.delta(ev.text, ev.reasoning)
                elif isinstance(ev, ToolCalls):
                    out += builder.tool_calls(ev.calls)
                elif isinstance(ev, Finished):
                    out += builder.finished(ev.finish_reason, feed.usage(ev), ev.stop_sequence)
                    done = True
                elif isinstance(ev, Failed):
                    # An explicit error event and no [DONE]: never a silent truncation.
                    self.metrics.rejections.labels(ev.error.code).inc()
                    out += builder.failed(ev.error)
                    done = True
            if out:
                yield bytes(out)
            if done:
                return

    def _closer(self, job: Job) -> Callable[[], None]:
        """The stream's cleanup: the job cancelled (a no-op once it ended)
        and the request counted closed for the drain."""
        def close() -> None:
            job.cancelled.set()
            self.lifecycle.request_closed()
        return close


class RelayedStream(StreamingResponse):
    """A streamed answer whose cleanup runs however the response ends. The
    stream generator's own `finally` is not enough: when the client is gone
    before Starlette first iterates it (it disconnected while the first token
    was on its way), Starlette cancels the response and never starts the
    generator, and the job would run on to its deadline, holding the worker."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class JobFeed:
    """The handler's view of one job's events, with every wait bounded:
    queue timeout, client disconnect and a stuck worker all end it."""

    def __init__(self, job: Job, request: Request, admission: AdmissionQueue[Job], queue_timeout_s: float,
                 health: Health, metrics: EngineMetrics) -> None:
        self.job = job
        self.request = request
        self.admission = admission
        self.queue_timeout_s = queue_timeout_s
        self.health = health
        self.metrics = metrics
        self.pending: deque[Event] = deque()
        self.queued_at = time.monotonic()
        self.first_token_seen = False
        self.started: Started | None = None

    def headers(self) -> dict[str, str]:
        """The answer's headers: its id, and what truncate_middle dropped of its prompt."""
        out = {"X-Request-Id": self.job.id}
        truncation = self.started.truncation if self.started is not None else None
        if truncation is not None:
            out[TRUNCATED_HEADER] = truncation.header()
        return out

    def usage(self, finished: Finished) -> Usage:
        """The finished answer's usage, with the prompt tokens truncate_middle dropped."""
        truncation = self.started.truncation if self.started is not None else None
        return Usage(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens,
                     truncation.dropped_tokens if truncation else 0)

    async def wait_started(self) -> Started:
        while True:
            for ev in await self.batch(check_disconnect=True):
                if isinstance(ev, Started):
                    self.metrics.queue_wait.observe(time.monotonic() - self.queued_at)
                    self.started = ev
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
                    self.metrics.ttft.observe(time.monotonic() - self.queued_at)
                if isinstance(events[0], Started) and len(events) > 1:
                    self.pending.extend(events[1:])
                    return events[:1]
                return events
            await self._check(check_disconnect)

    async def _check(self, check_disconnect: bool) -> None:
        if check_disconnect and await self.request.is_disconnected():
            raise ClientGone()
        waited = time.monotonic() - self.queued_at
        if self.admission.position(self.job) is not None:
            if waited > self.queue_timeout_s and self.admission.withdraw(self.job):
                raise self.admission.timeout_error(waited)
            return
        if waited > self.queue_timeout_s and self.health.waiting_for_room(self.job.id):
            # Taken from the queue but still waiting for room in the batch: the same timeout,
            # and the worker drops the job once it sees it cancelled (engine/core/engine_core.py).
            self.job.cancelled.set()
            raise self.admission.timeout_error(waited)
        self.health.check_progress(self.job.id)
