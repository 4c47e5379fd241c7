"""Admission: a bounded FIFO queue in front of the worker's slots (one by
default: single concurrency; `max_concurrency` more, for batching).

`decide_admission` is the pure policy; `AdmissionQueue` is the one owner of
the waiting line, shared by the HTTP handlers (offer / withdraw) and the model
worker (take / done). Its lock guards nothing else.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..model.errors import EngineError

T = TypeVar("T")


@dataclass(frozen=True)
class AdmissionState:
    waiting: int  # requests in the queue
    running: int  # requests the worker holds
    capacity: int  # most requests allowed to wait
    accepting: bool = True  # False while draining or after a fatal error
    slots: int = 1  # requests the worker may hold at once


def retry_after_s(waiting: int, mean_service_s: float) -> int:
    """A Retry-After hint: the time for the line ahead to clear, 1..60 s."""
    return max(1, min(60, round((waiting + 1) * mean_service_s)))


def decide_admission(state: AdmissionState, mean_service_s: float) -> EngineError | None:
    """None to admit, or the error to answer with. Pure."""
    if not state.accepting:
        return EngineError(503, "the engine is shutting down or restarting; retry shortly",
                           code="engine_unavailable", retry_after=5)
    # A free slot with nobody waiting takes the job at once, even at capacity 0.
    if state.waiting >= state.capacity and (state.running >= state.slots or state.waiting > 0):
        return EngineError(
            429,
            f"the engine is busy: {state.waiting} request(s) already waiting (queue limit {state.capacity})",
            code="queue_full",
            retry_after=retry_after_s(state.waiting, mean_service_s),
        )
    return None


def queue_timeout_error(waited_s: float, mean_service_s: float, waiting: int) -> EngineError:
    return EngineError(
        503,
        f"timed out after {waited_s:.1f}s waiting for the engine (its running requests hold every slot)",
        code="queue_timeout",
        retry_after=retry_after_s(waiting, mean_service_s),
    )


class AdmissionQueue(Generic[T]):
    """Thread-safe FIFO of waiting jobs plus the jobs the worker holds."""

    def __init__(self, capacity: int, slots: int = 1) -> None:
        self.capacity = capacity
        self.slots = slots
        self._cond = threading.Condition()
        self._waiting: deque[T] = deque()
        self._running: list[T] = []
        self._accepting = True
        self._service_ewma_s = 2.0  # mean time a request holds the worker
        self.max_observed_waiting = 0

    # --- handler side -------------------------------------------------
    def offer(self, job: T) -> EngineError | None:
        """Queue `job`, or return why not."""
        with self._cond:
            state = AdmissionState(len(self._waiting), len(self._running), self.capacity, self._accepting, self.slots)
            refusal = decide_admission(state, self._service_ewma_s)
            if refusal is not None:
                return refusal
            self._waiting.append(job)
            self.max_observed_waiting = max(self.max_observed_waiting, len(self._waiting))
            self._cond.notify_all()
            return None

    def withdraw(self, job: T) -> bool:
        """Remove a job still waiting (timeout, client gone). False if the
        worker already took it."""
        with self._cond:
            try:
                self._waiting.remove(job)
                return True
            except ValueError:
                return False

    def position(self, job: T) -> int | None:
        with self._cond:
            try:
                return self._waiting.index(job)
            except ValueError:
                return None

    def timeout_error(self, waited_s: float) -> EngineError:
        with self._cond:
            return queue_timeout_error(waited_s, self._service_ewma_s, len(self._waiting))

    # --- worker side --------------------------------------------------
    def take(self, timeout: float) -> T | None:
        """Block until a job is waiting (or `timeout`; 0: do not wait); it
        becomes running."""
        with self._cond:
            assert len(self._running) < self.slots, "take() with every slot held"
            if not self._waiting and timeout > 0:
                self._cond.wait(timeout)
            if not self._waiting:
                return None
            job = self._waiting.popleft()
            self._running.append(job)
            return job

    def wake(self) -> None:
        """A worker waiting in take() returns now (other work came: an embedding request)."""
        with self._cond:
            self._cond.notify_all()

    def has_waiting(self) -> bool:
        return bool(self._waiting)  # a read of a length: no lock needed for a hint

    def done(self, job: T, service_s: float) -> None:
        with self._cond:
            assert job in self._running, "done() for a job that is not running"
            self._running.remove(job)
            # Service time per slot: with n running, one ends every service_s / n.
            self._service_ewma_s = 0.8 * self._service_ewma_s + 0.2 * service_s / self.slots

    # --- lifecycle ----------------------------------------------------
    def close(self) -> list[T]:
        """Stop accepting; return the jobs that were waiting (now removed)."""
        with self._cond:
            self._accepting = False
            dropped = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
            return dropped

    def snapshot(self) -> dict[str, int | bool]:
        with self._cond:
            return {
                "waiting": len(self._waiting),
                "running": len(self._running),
                "slots": self.slots,
                "capacity": self.capacity,
                "accepting": self._accepting,
                "max_observed_waiting": self.max_observed_waiting,
            }
