"""MLX's memory figures as the runner reads them (three C calls): what the
core publishes for /health and /metrics (engine/core/worker_state.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemorySnapshot:
    active_bytes: int = 0
    peak_bytes: int = 0
    cache_bytes: int = 0
    taken_at: float = 0.0  # monotonic
