"""Embedding and rerank requests on their way to the worker: a short
bounded line of their own, beside the chat requests' admission queue.

An encoder's forward over a request's inputs takes milliseconds, so an
embedding request is not a chat request's equal that waits for a whole answer
(an agent's memory lookup between its turns would wait behind another agent's
long answer): the core serves one waiting embedding request between two steps
of whatever runs (engine/core/engine_core.py). The handler waits on the job's
future. `EmbeddingQueue` is the one owner of the line; a put wakes the worker
if it is waiting for chat requests.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from ..model.errors import EngineError
from .side_jobs import JOIN_INPUTS, EmbedJob, JoinedEmbedJob, RerankJob, SideJob

__all__ = ["EMBEDDING_QUEUE", "EmbedJob", "EmbeddingQueue", "JoinedEmbedJob", "RerankJob", "SideJob"]

EMBEDDING_QUEUE = 64  # waiting requests; one more is a 429


class EmbeddingQueue:
    def __init__(self, wake: Callable[[], None], capacity: int = EMBEDDING_QUEUE) -> None:
        self._wake = wake
        self.capacity = capacity
        self._lock = threading.Lock()
        self._waiting: deque[SideJob] = deque()
        self._accepting = True

    def offer(self, job: SideJob) -> EngineError | None:
        with self._lock:
            if not self._accepting:
                return EngineError(503, "the engine is shutting down or restarting; retry shortly",
                                   code="engine_unavailable", retry_after=5)
            if len(self._waiting) >= self.capacity:
                return EngineError(429, f"the engine is busy: {len(self._waiting)} embedding and rerank "
                                        "requests already waiting", code="queue_full", retry_after=1)
            self._waiting.append(job)
        self._wake()
        return None

    def take(self) -> SideJob | None:
        """The first job in line; an embedding request takes the embedding
        requests for its model right behind it along (a JoinedEmbedJob, up
        to JOIN_INPUTS inputs in all): several clients' inputs sorted by
        length together, in full forwards."""
        with self._lock:
            if not self._waiting:
                return None
            job = self._waiting.popleft()
            if not isinstance(job, EmbedJob):
                return job
            parts, inputs = [job], len(job.inputs)
            while self._waiting:
                nxt = self._waiting[0]
                if not isinstance(nxt, EmbedJob) or nxt.model_id != job.model_id \
                        or inputs + len(nxt.inputs) > JOIN_INPUTS:
                    break
                parts.append(self._waiting.popleft())
                inputs += len(nxt.inputs)
            return job if len(parts) == 1 else JoinedEmbedJob(tuple(parts))

    def put_back(self, job: SideJob) -> None:
        """A job taken that waits its turn again, first in line."""
        with self._lock:
            self._waiting.appendleft(job)

    def has_waiting(self) -> bool:
        return bool(self._waiting)  # a read of a length: a hint

    def close(self, error: EngineError) -> None:
        """Stop accepting; every waiting request is told `error`."""
        with self._lock:
            self._accepting = False
            dropped = list(self._waiting)
            self._waiting.clear()
        for job in dropped:
            if not job.future.done():
                job.future.set_exception(error)
