"""The engine's device memory as seen from outside, and what it leaves MLX.

MLX bounds what it allocates (its active buffers plus its buffer cache) by
`mx.set_memory_limit`; the process holds more than that on a CUDA card: the
CUDA context and the libraries' workspaces (cuBLAS, cuDNN), which MLX does
not count. Measured on the H100 (8B demo model, four agents): nvidia-smi
showed the process at 64.1 GiB against a 59.7 GiB budget while MLX's active
and cached memory summed to its limit, 59.7 GiB: 4.4 GiB outside MLX.

So where nvidia-smi can see the process, a watch thread measures it every
few seconds, takes what MLX does not account for (the largest seen: such
memory grows with the shapes run and is rarely given back) and the worker
lowers MLX's limit by it (`mlx_limit`), so the process as nvidia-smi sees it
stays within the budget. On Metal and the CPU nothing is outside MLX worth
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
INTERVAL_S = 5.0  # between measurements
LIMIT_FLOOR = 0.5  # MLX keeps at least this share of the budget, whatever is measured outside it


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
    outside MLX, never below LIMIT_FLOOR of the budget (a wild measurement
    must not starve the model)."""
    return max(int(budget_bytes * LIMIT_FLOOR), budget_bytes - max(0, outside_bytes))


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
    outside_bytes: int  # the most seen of process - MLX: what MLX's limit must leave
    taken_at: float


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
        while not self._stop_event.is_set():
            process = self.measure(self.pid)
            if process is None:
                return  # no nvidia-smi, or it does not list us: nothing to measure here
            mlx = self.mlx_bytes()
            before = self.latest.outside_bytes if self.latest is not None else 0
            self.latest = DeviceMemory(process, mlx, max(before, process - mlx), time.monotonic())
            if self.latest.outside_bytes > before + 256 * MIB:
                log.info("device memory: the process holds %.2f GiB outside MLX (nvidia-smi %.2f GiB, MLX %.2f GiB)",
                         self.latest.outside_bytes / 2**30, process / 2**30, mlx / 2**30)
            self._stop_event.wait(self.interval_s)
