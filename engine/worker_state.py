"""What the model worker publishes for other threads: its phase and the
requests it holds (`WorkerStatus`), MLX's memory (`MemorySnapshot`).
Immutable objects, replaced whole by the worker thread."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


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
    in_flight: str | None = None  # request id (the oldest, when several run)
    in_flight_fingerprint: str | None = None
    since: float = field(default_factory=time.monotonic)  # phase start
    last_progress: float = field(default_factory=time.monotonic)
    in_flight_ids: tuple[str, ...] = ()  # every request running


@dataclass(frozen=True)
class MemorySnapshot:
    active_bytes: int = 0
    peak_bytes: int = 0
    cache_bytes: int = 0
    taken_at: float = 0.0
