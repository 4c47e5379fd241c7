"""The crash journal's in-flight record: the requests running, on disk
(`run/engine.inflight.json`, core/records.py's `InflightRequest`), for the
crash listener to blame a crash on (and eventually quarantine them).

One owner, `InflightRecord`: the core hands it the running requests as they
change (`note`, no disk), and a thread of its own writes the latest of them
(older ones it never reached are skipped: only the newest matters), so no
file is written under the core's step. A request is handed over before any
of its MLX work runs; the write lands while that work starts (an MLX fault
comes after the GPU ran, and eval lets the writer's thread run). An injected
fault (engine/model/faults.py) and an MLX error's exit wait for it (`flush`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from mlxd.records import InflightRequest

from ..model.mlx_memory import MemorySnapshot

log = logging.getLogger("mlxd.engine.core.worker")

FLUSH_S = 1.0  # the most a flush waits for the writer (a disk that hangs costs the record, not the engine)


def inflight_request(jobs: Sequence[Any], memory: MemorySnapshot) -> InflightRequest | None:
    """The record of these running jobs, oldest first (None: nothing runs, the file goes)."""
    if not jobs:
        return None
    job = jobs[0]
    return InflightRequest(request_id=job.id, fingerprint=job.fingerprint, model=job.model_id, pid=os.getpid(),
                           started=time.time(), requests=[{"request_id": j.id, "fingerprint": j.fingerprint}
                                                          for j in jobs],
                           memory={"mlx_active_bytes": memory.active_bytes, "mlx_peak_bytes": memory.peak_bytes,
                                   "mlx_cache_bytes": memory.cache_bytes})


class InflightRecord:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._changed = threading.Condition()
        self._latest: InflightRequest | None = None
        self._noted = 0  # records handed over
        self._written = 0  # the newest of them on disk (or given up on)
        self._thread: threading.Thread | None = None

    def discard(self) -> None:
        """At boot: the last run's record goes (the listener has read it by now)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def note(self, jobs: Sequence[Any], memory: MemorySnapshot) -> None:
        """The running jobs, oldest first, for the writer (the worker thread; no disk)."""
        if self.path is None:
            return
        record = inflight_request(jobs, memory)
        with self._changed:
            self._latest, self._noted = record, self._noted + 1
            self._changed.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxd-inflight-writer", daemon=True)
            self._thread.start()

    def flush(self, limit_s: float = FLUSH_S) -> bool:
        """Wait until the newest record handed over is on disk; whether it is."""
        with self._changed:
            return self._changed.wait_for(lambda: self._written >= self._noted, limit_s)

    def write(self, record: InflightRequest | None) -> None:
        """One record to disk, atomically (none: the file goes)."""
        assert self.path is not None
        try:
            if record is None:
                self.path.unlink(missing_ok=True)
            else:
                record.write(self.path, durable=False)
        except OSError as exc:  # a full disk must not take requests down
            log.warning("cannot record the in-flight request: %s", exc)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._written < self._noted)
                record, noted = self._latest, self._noted
            self.write(record)
            with self._changed:
                self._written = noted
                self._changed.notify_all()
