"""The engine's device memory as seen from outside, and what it leaves MLX.

MLX bounds what it allocates (its active buffers plus its buffer cache) by
`mx.set_memory_limit`; the process holds more than that on a CUDA card: the
CUDA context and the libraries' workspaces (cuBLAS, cuDNN), which MLX does
not count: with MLX at its limit (the budget), the process stood gigabytes
over it (docs/BENCHMARKS.md, "Why the engine is built as it is").

So where nvidia-smi can see the process, a watch thread measures it every
few seconds, takes what MLX does not account for (the largest seen, once a
second reading confirms it: such memory grows with the shapes run and is
rarely given back, while nvidia-smi lags MLX giving buffers back) and the
core lowers MLX's limit by it and room for it to grow (`mlx_limit`), so the
process as nvidia-smi sees it stays within the budget. On Metal and the CPU nothing is outside MLX worth
counting (no such tool either): the limit is the budget.

The thread reads MLX's memory counters (plain getters; it never allocates or
runs anything on the device) right after nvidia-smi answers, so both figures
are of one moment.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("mlxd.engine.core.worker")

MIB = 2**20
INTERVAL_S = 2.0  # between measurements
LIMIT_FLOOR = 0.5  # MLX keeps at least this share of the budget, whatever is measured outside it
# Memory outside MLX grows with new shapes (cuBLAS workspaces, kernels) between two measurements:
# room is left for this share more (four agents on an H100 grew it 0.3-0.4 GiB a step from 3.2 GiB).
OUTSIDE_GROWTH = 0.25
# A reading counts once the next one confirms it (the least of the two): nvidia-smi lags MLX's counters when MLX
# gives buffers back, which once read as 18.9 GiB outside MLX for a moment (four agents, H100) and took MLX's
# limit, and the prompt cache with it, down by as much.
CONFIRMATIONS = 2


def parse_compute_apps(text: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`
    -> {pid: bytes}; a process on several GPUs is summed; odd lines skipped (pure)."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2:
            continue
        try:
            pid, mib = int(parts[0]), float(parts[1])
        except ValueError:
            continue
        out[pid] = out.get(pid, 0) + int(mib * MIB)
    return out


def mlx_limit(budget_bytes: int, outside_bytes: int) -> int:
    """MLX's memory limit (pure): the budget less what the process holds
    outside MLX and room for it to grow by OUTSIDE_GROWTH before the next
    measurement, never below LIMIT_FLOOR of the budget (a wild measurement
    must not starve the model)."""
    outside = max(0, outside_bytes)
    return max(int(budget_bytes * LIMIT_FLOOR), budget_bytes - outside - int(outside * OUTSIDE_GROWTH))


def confirmed_outside(recent: list[int]) -> int:
    """What the latest readings of memory outside MLX show for certain (pure):
    the least of the last CONFIRMATIONS, so one stale reading never counts."""
    return max(0, min(recent[-CONFIRMATIONS:])) if recent else 0


def process_device_bytes(pid: int, timeout_s: float = 10.0) -> int | None:
    """The process's device memory as nvidia-smi reports it; None without
    nvidia-smi, or where it does not list the process (a container may hide pids)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_compute_apps(out).get(pid)


@dataclass(frozen=True)
class DeviceMemory:
    """One measurement, published whole."""

    process_bytes: int  # the process on the device, as nvidia-smi sees it
    mlx_bytes: int  # MLX's active + cached memory at that moment
    outside_bytes: int  # the most seen of process - MLX (each confirmed): what MLX's limit must leave
    taken_at: float


def over_budget(latest: DeviceMemory | None, budget_bytes: int, trimmed_at: float) -> bool:
    """Whether a measurement newer than the last trim saw the process over
    its budget on the device (pure): MLX's buffer cache is then given back,
    once a measurement. (Buffers freed to CUDA's pool stay the process's
    until MLX clears its cache; a clear costs a sync and the next steps'
    allocations, so never as a matter of course: on the lent H100, one at
    every joining prompt made the decode steps ~20 % slower.)"""
    return latest is not None and latest.taken_at > trimmed_at and latest.process_bytes > budget_bytes


class DeviceMemoryWatch(threading.Thread):
    """Measures the process's device memory every INTERVAL_S while nvidia-smi
    sees it; `latest` is the last measurement (None until one succeeds).
    Stops looking after the first measurement that finds nothing."""

    def __init__(self, pid: int, mlx_bytes: Callable[[], int],
                 measure: Callable[[int], int | None] = process_device_bytes, interval_s: float = INTERVAL_S) -> None:
        super().__init__(name="mlxd-device-memory", daemon=True)
        self.pid = pid
        self.mlx_bytes = mlx_bytes
        self.measure = measure
        self.interval_s = interval_s
        self.latest: DeviceMemory | None = None
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        recent: list[int] = []
        while not self._stop_event.is_set():
            mlx_before = self.mlx_bytes()
            process = self.measure(self.pid)
            if process is None:
                return  # no nvidia-smi, or it does not list us: nothing to measure here
            mlx = max(mlx_before, self.mlx_bytes())  # MLX may have given buffers back while nvidia-smi ran
            recent = [*recent, process - mlx][-CONFIRMATIONS:]
            before = self.latest.outside_bytes if self.latest is not None else 0
            self.latest = DeviceMemory(process, mlx, max(before, confirmed_outside(recent)), time.monotonic())
            if self.latest.outside_bytes > before + 256 * MIB:
                log.info("device memory: the process holds %.2f GiB outside MLX (nvidia-smi %.2f GiB, MLX %.2f GiB)",
                         self.latest.outside_bytes / 2**30, process / 2**30, mlx / 2**30)
            self._stop_event.wait(self.interval_s)
