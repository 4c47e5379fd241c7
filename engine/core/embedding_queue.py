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
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..model.errors import EngineError
from ..model.rerank_decisions import RerankWork

if TYPE_CHECKING:
    from ..model.runner import ModelRunner

EMBEDDING_QUEUE = 64  # waiting requests; one more is a 429


class SideRun(Protocol):
    """A request's forwards, a group at a time (engine/core/embedding_turn.py steps it)."""

    tokens: int

    def step(self) -> bool: ...


@dataclass(frozen=True)
class EmbedJob:
    """One /v1/embeddings request for the worker: its inputs as strings or token ids."""

    model_id: str
    inputs: list[str] | list[list[int]]
    truncate: bool
    keep_alive_s: float | None
    future: Future = field(default_factory=Future, compare=False)  # the vectors (numpy, n x d) and the token count
    kind = "embedding"

    def start(self, runner: ModelRunner) -> SideRun:
        """Its encoder resident (loaded when another or none is), its inputs tokenized."""
        encoder = runner.load_encoder(self.model_id)
        return encoder.start(encoder.tokenize(self.inputs, self.truncate))

    def result(self, run: Any) -> tuple[Any, int]:
        return run.vectors(), run.tokens

    def counted(self, run: Any) -> dict[str, int]:
        return {"embedding_requests": 1, "embedding_inputs": len(run.ids), "embedding_tokens": run.tokens}


@dataclass(frozen=True)
class RerankJob:
    """One /v1/rerank request for the worker: the reranker's id and the work."""

    model_id: str
    work: RerankWork
    keep_alive_s: float | None
    future: Future = field(default_factory=Future, compare=False)  # the scores (one a document) and the token count
    kind = "rerank"

    def start(self, runner: ModelRunner) -> SideRun:
        return runner.start_rerank(self.model_id, self.work)

    def result(self, run: Any) -> tuple[list[float], int]:
        return run.scores(), run.tokens

    def counted(self, run: Any) -> dict[str, int]:
        return {"rerank_requests": 1, "rerank_documents": len(self.work.documents), "rerank_tokens": run.tokens}


SideJob = EmbedJob | RerankJob


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
        with self._lock:
            return self._waiting.popleft() if self._waiting else None

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
