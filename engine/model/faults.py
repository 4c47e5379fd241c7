"""Fault injection: reproduce a Metal crash, hang or MLX error on demand.

Off unless the engine's environment sets it; nothing over HTTP can turn it
on. Two sources, both read by the worker:

  MLXD_FAULT="ACTION@POINT[:N]"       fixed for the process's life
  MLXD_FAULT_FILE=/path/to/file       the file holds a spec; it is read at
                                      boot, at each job start and while
                                      idle; remove the file to stop it

ACTION: abort  (os.abort(): SIGABRT, as Metal's check_error does)
        oom    (print MLX's real Metal out-of-memory message to stderr, then abort)
        hang   (block forever, ignoring cancellation)
        raise  (raise RuntimeError with a Metal-like message, as mlx >= 0.32)
        exit   (os._exit(1), like an uncaught Python error)
        kill   (SIGKILL: what kill -9 or the OOM killer does)
        slow   (@prefill: every prefill step sleeps N ms per token, as a slow machine's would take;
                @kv_write: every prompt-cache file takes N ms longer to write, as on a slow disk)
POINT:  boot   (engine start, before the preload)
        load   (before loading a model)
        start  (a request was admitted, before its first token)
        token  (after N generated tokens; N defaults to 1)
        idle   (the worker is idle)
        kv_write (a prompt-cache entry is written but not yet in place: on the writer's thread)
        prefill (each prefill step; only for slow)
A spec in the file may end in "/once": the file is removed as the fault
fires, so the restarted engine serves the retry. Several specs may be joined with commas. MLXD_FAULT_MATCH="text" limits
start/token faults to requests whose prompt contains the text (a "poison"
request, for the quarantine tests).

Beside the injection: the crash journal's line for a backend limit
(`backend_limit_record`), the one fault the engine survives -- an op or
dtype the backend cannot run, answered and reloaded in float32, not an exit
(engine/model/errors.py, `backend_limit`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlxd.records import CrashRecord

from .errors import BACKEND_UNSUPPORTED

ACTIONS = ("abort", "oom", "hang", "raise", "exit", "kill", "slow")
CRASHES = ("abort", "oom", "exit", "kill", "raise")  # the actions that end the process (raise: as an MLX error does)
POINTS = ("boot", "load", "start", "token", "idle", "kv_write", "prefill")
SLOW_POINTS = ("prefill", "kv_write")
# What libmlx prints before aborting when Metal runs out of memory.
METAL_OOM_MESSAGE = ("libc++abi: terminating due to uncaught exception of type std::runtime_error: "
                     "[METAL] Command buffer execution failed: Insufficient Memory "
                     "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)")
METAL_MESSAGE = "[METAL] Command buffer execution failed: Internal Error (0000000e:Internal Error) (fault injected)"


class InjectedMLXError(RuntimeError):
    """Stands in for the RuntimeError mlx raises on a Metal failure."""


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    n: int = 1
    once: bool = False  # the fault file goes as it fires

    def fires_at(self, point: str, tokens: int = 0) -> bool:
        if point != self.point:
            return False
        return point != "token" or tokens >= self.n


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """'abort@token:3,raise@load' -> Faults (pure). ValueError names the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        part, _, modifier = part.partition("/")
        if modifier not in ("", "once"):
            raise ValueError(f"bad fault spec {part!r}: the only modifier is /once")
        action, sep, where = part.partition("@")
        point, _, n = where.partition(":")
        if not sep or action not in ACTIONS or point not in POINTS:
            raise ValueError(f"bad fault spec {part!r}: want ACTION@POINT[:N] with ACTION in {ACTIONS}, POINT in {POINTS}")
        if (action == "slow" and point not in SLOW_POINTS) or (point == "prefill" and action != "slow"):
            raise ValueError(f"bad fault spec {part!r}: slow goes with @prefill or @kv_write, and @prefill only "
                             "with slow")
        try:
            count = int(n) if n else 1
        except ValueError:
            raise ValueError(f"bad fault spec {part!r}: N must be an integer") from None
        faults.append(Fault(action, point, count, modifier == "once"))
    return tuple(faults)


def trigger(fault: Fault) -> None:
    """Carry the fault out. Does not return except for 'raise' (which raises)."""
    if fault.action == "abort":
        os.abort()
    if fault.action == "oom":
        os.write(2, (METAL_OOM_MESSAGE + "\n").encode())
        os.abort()
    if fault.action == "exit":
        os._exit(1)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "raise":
        raise InjectedMLXError(METAL_MESSAGE)
    forever = threading.Event()
    while True:  # hang: a stuck GPU call does not answer cancellation either
        forever.wait(3600)
        time.sleep(0)


class FaultInjector:
    """Owned by the worker thread. Cheap when no fault is configured."""

    def __init__(self, env_spec: str | None, spec_file: str | None, match: str | None = None) -> None:
        self._fixed = parse_faults(env_spec) if env_spec else ()
        self.match = match or None
        self._file = Path(spec_file) if spec_file else None
        self.active: tuple[Fault, ...] = self._fixed
        # Called before an injected crash: MLX's own comes after the GPU ran a command buffer, time the
        # in-flight record's writer has had (engine/core/inflight_record.py); an injected one comes at once.
        self.before_crash: Callable[[], object] = lambda: None

    @classmethod
    def from_environ(cls) -> "FaultInjector":
        return cls(os.environ.get("MLXD_FAULT"), os.environ.get("MLXD_FAULT_FILE"), os.environ.get("MLXD_FAULT_MATCH"))

    def applies_to(self, prompt_text: str) -> bool:
        """Request-bound faults fire only for matching requests."""
        return self.match is None or self.match in prompt_text

    @property
    def enabled(self) -> bool:
        return bool(self._fixed) or self._file is not None

    def refresh(self) -> None:
        """Re-read the fault file (at job start and while idle)."""
        if self._file is None:
            return
        try:
            from_file = parse_faults(self._file.read_text())
        except (OSError, ValueError):
            from_file = ()
        self.active = self._fixed + from_file

    def prefill_delay_s(self, tokens: int) -> float:
        """Seconds a prefill step of `tokens` is made to last longer (slow@prefill:N)."""
        return sum(f.n for f in self.active if f.action == "slow" and f.point == "prefill") * tokens / 1000

    def check(self, point: str, tokens: int = 0, request_text: str | None = None) -> None:
        if request_text is not None and not self.applies_to(request_text):
            return
        for fault in self.active:
            if fault.fires_at(point, tokens):
                if fault.action == "slow":  # kv_write: a slow disk (a slow prefill is prefill_delay_s's)
                    time.sleep(fault.n / 1000)
                    continue
                if fault.once and self._file is not None:
                    self._file.unlink(missing_ok=True)
                    self.active = self._fixed
                if fault.action in CRASHES:
                    self.before_crash()
                trigger(fault)


def backend_limit_record(now: float, pid: int, model_id: str, limit: str,
                         requests: list[tuple[str, str]], reloading: bool) -> CrashRecord:
    """The crash journal's line for a backend limit (pure): the class
    `backend_unsupported` (supervisor/exit_classes.py), which is no exit and
    no evidence against the requests in flight (every request fails on the
    model as loaded); `requests`: (request id, fingerprint), oldest first."""
    return CrashRecord(time=now, klass=BACKEND_UNSUPPORTED, handled_at=now, pid=pid, model=model_id,
                       request_id=requests[0][0] if requests else None,
                       fingerprint=requests[0][1] if requests else None,
                       requests=[{"request_id": rid, "fingerprint": fp} for rid, fp in requests],
                       stderr_tail=f"{limit} ({'reloading the model as float32' if reloading else 'float32 already'})")


def append_to_journal(path: Path, record: CrashRecord) -> None:
    """One whole line appended with a single write (O_APPEND), as the crash
    listener appends (supervisor/journal.py; it rotates the file, not us)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, record.to_line())
    finally:
        os.close(fd)
