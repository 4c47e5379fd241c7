"""Embedding requests on their way to the worker: a short bounded line of
their own, beside the chat requests' admission queue.

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

EMBEDDING_QUEUE = 64  # waiting requests; one more is a 429


@dataclass(frozen=True)
class EmbedJob:
    """One /v1/embeddings request for the worker: its inputs as strings or token ids."""

    model_id: str
    inputs: list[str] | list[list[int]]
    truncate: bool
    keep_alive_s: float | None
    future: Future = field(default_factory=Future, compare=False)  # the vectors (numpy, n x d) and the token count


class EmbeddingQueue:
    def __init__(self, wake: Callable[[], None], capacity: int = EMBEDDING_QUEUE) -> None:
        self._wake = wake
        self.capacity = capacity
        self._lock = threading.Lock()
        self._waiting: deque[EmbedJob] = deque()
        self._accepting = True

    def offer(self, job: EmbedJob) -> EngineError | None:
        with self._lock:
            if not self._accepting:
                return EngineError(503, "the engine is shutting down or restarting; retry shortly",
                                   code="engine_unavailable", retry_after=5)
            if len(self._waiting) >= self.capacity:
                return EngineError(429, f"the engine is busy: {len(self._waiting)} embedding requests already "
                                        "waiting", code="queue_full", retry_after=1)
            self._waiting.append(job)
        self._wake()
        return None

    def take(self) -> EmbedJob | None:
        with self._lock:
            return self._waiting.popleft() if self._waiting else None

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
