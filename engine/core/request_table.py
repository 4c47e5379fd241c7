"""Every request the worker holds, with one status each: the one place that
says who is waiting, prefilling or decoding.

Owned by the worker thread. Other threads never read the table: the worker
publishes its rows whole in `WorkerStatus.requests` (engine/core/worker_state.py),
and /health, /metrics, the drain and the in-flight record read that snapshot
(before it, "who is running" was kept five ways that disagreed, and the drain
iterated a dict the worker mutated).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # taken from the queue and prepared: waits for room in the batch, or for it to drain
    PREFILLING = "prefilling"  # its prompt into its KV (or its model loading, or tokenizing)
    DECODING = "decoding"  # it has its first token


@dataclass(frozen=True)
class HeldRequest:
    id: str
    fingerprint: str | None
    status: RequestStatus
    since: float  # monotonic: when it came to this status
    job: Any = field(default=None, compare=False, repr=False)  # the Job, for the drain to cancel


def running(rows: tuple[HeldRequest, ...]) -> tuple[HeldRequest, ...]:
    """The rows prefilling or decoding (not those waiting for room)."""
    return tuple(r for r in rows if r.status is not RequestStatus.WAITING)


class RequestTable:
    """The worker's requests in the order it took them (see the module's docstring)."""

    def __init__(self) -> None:
        self._held: dict[str, HeldRequest] = {}

    def hold(self, job: Any, status: RequestStatus) -> None:
        """The job is held with this status (taken now, or moved on)."""
        held = self._held.get(job.id)
        if held is None or held.status is not status:
            self._held[job.id] = HeldRequest(job.id, job.fingerprint, status, time.monotonic(), job)

    def release(self, job: Any) -> None:
        self._held.pop(job.id, None)

    def rows(self) -> tuple[HeldRequest, ...]:
        return tuple(self._held.values())
