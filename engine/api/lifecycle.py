"""The engine process's lifecycle: start the worker (it preloads the default
model), drain on SIGTERM, exit at once on an MLX error.

`Lifecycle` owns the process-level state: whether it is draining, the fatal
exit under way, and the requests still to be answered before the process
may exit. It lives on the event loop; the worker thread reaches it only
through the `on_fatal` callback, which hands over to the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import traceback
from typing import Callable

from mlxd import exit_codes

from ..core.admission import AdmissionQueue
from ..core.embedding_queue import EmbeddingQueue
from ..model.errors import EngineError
from ..model.events import Failed
from ..model.job import Job
from ..core.worker import ModelWorker

log = logging.getLogger("mlxd.engine")
OnFatal = Callable[[BaseException, Job | None], None]
ANSWER_BEFORE_EXIT_S = 3.0  # how long a fatal exit waits for the failed request's answer to go out


class Lifecycle:
    def __init__(self, admission: AdmissionQueue[Job], shutdown_grace_s: float,
                 make_worker: Callable[[OnFatal], ModelWorker], embeddings: EmbeddingQueue | None = None) -> None:
        self.admission = admission
        self.embeddings = embeddings
        self.shutdown_grace_s = shutdown_grace_s
        self.worker = make_worker(self._on_fatal_from_worker)
        self.draining = False
        self.exiting_reason: str | None = None  # a fatal error: exiting within seconds
        self.open_requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.worker.start()

    def stop(self, timeout: float) -> None:
        self.worker.stop()
        self.worker.join(timeout)

    def request_opened(self) -> None:
        self.open_requests += 1

    def request_closed(self) -> None:
        self.open_requests -= 1

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work, fail queued jobs fast, give the running
        ones `shutdown_grace_s` to finish, then cancel them."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: no new requests; %s running", self.worker.status.in_flight or "none")
        self._fail_waiting(EngineError(503, "the engine is shutting down", code="engine_unavailable", retry_after=5))
        if self._loop is not None:
            self._loop.call_later(self.shutdown_grace_s, self._cancel_running)

    def _cancel_running(self) -> None:
        for running in self.worker.running_jobs():
            log.info("grace period over: cancelling %s", running.id)
            running.cancelled.set()

    def _fail_waiting(self, error: EngineError) -> None:
        for job in self.admission.close():
            job.channel.put(Failed(error))
        if self.embeddings is not None:
            self.embeddings.close(error)

    def _on_fatal_from_worker(self, exc: BaseException, job: Job | None) -> None:
        # Worker thread: hand over to the loop thread.
        text = "".join(traceback.format_exception(exc)).rstrip()
        print(f"mlxd-engine: fatal MLX error ({type(exc).__name__}): {exc}", file=sys.stderr, flush=True)
        log.error("fatal error in the model worker (request %s):\n%s", job.id if job else None, text)
        code = exit_codes.PRELOAD_FAILED if isinstance(exc, EngineError) else exit_codes.MLX_ERROR
        if self._loop is None:
            os._exit(code)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._fatal_exit(str(exc), code)))

    async def _fatal_exit(self, reason: str, code: int) -> None:
        # "exiting", not "unhealthy": the supervisor must let us deliver the
        # failed request's error and exit with our code, not kill us as hung.
        self.exiting_reason = f"fatal: {reason}"
        self._fail_waiting(EngineError(503, "the engine hit an MLX error and is restarting", code="engine_restarting",
                                       retry_after=5))
        deadline = time.monotonic() + ANSWER_BEFORE_EXIT_S
        while self.open_requests > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # let the failed request's answer reach its client
        logging.shutdown()
        os._exit(code)
