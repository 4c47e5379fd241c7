"""What the model worker publishes for other threads: its phase and the
requests it holds (`WorkerStatus`, its request table's rows); MLX's memory beside it is
the runner's `MemorySnapshot` (engine/model/mlx_memory.py).
Immutable objects, replaced whole by the worker thread."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .request_table import HeldRequest, running


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
    requests: tuple[HeldRequest, ...] = ()  # every request the worker holds, oldest first (engine/core/request_table.py)
    since: float = field(default_factory=time.monotonic)  # phase start
    last_progress: float = field(default_factory=time.monotonic)

    @property
    def running(self) -> tuple[HeldRequest, ...]:
        """The requests prefilling or decoding (not those waiting for room)."""
        return running(self.requests)

    @property
    def in_flight_ids(self) -> tuple[str, ...]:
        return tuple(r.id for r in self.running)

    @property
    def in_flight(self) -> str | None:
        """The oldest running request's id."""
        running = self.running
        return running[0].id if running else None

    @property
    def in_flight_fingerprint(self) -> str | None:
        running = self.running
        return running[0].fingerprint if running else None
