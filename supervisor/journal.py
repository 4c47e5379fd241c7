"""The crash journal: one JSON line per engine exit, in state/crashes.jsonl
(and one per backend limit the engine survived, `backend_unsupported`, which
the engine appends itself: no exit, no crash, no evidence).

Appends are a single write() of a whole line on an O_APPEND descriptor, so a
kill -9 of the writer at any moment leaves whole records (a torn last line,
should the machine itself die mid-write, is skipped on reading). Rotation
renames the file to crashes.jsonl.1 (atomic) once it passes max_bytes.
Records are mlxd.records.CrashRecord; `crash_record` builds one from the
policy's RecordCrash action (pure), and the readers here are pure over the
records: counts and the quarantine verdicts (`quarantine_verdicts`: a
request is blamed only on evidence, alone in flight at a crash).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from mlxd.records import CrashRecord
from mlxd.reports import EngineHealth

from .exit_classes import NOT_EXITS, ExitClass, classify_exit, exit_signal, signal_name
from .policy import RecordCrash

STDERR_TAIL_LINES = 12
STDERR_TAIL_CHARS = 2000


def crash_record(action: RecordCrash, last_health: EngineHealth | None, handled_at: float) -> CrashRecord:
    """The journal line for one exit: what the policy decided about it, what
    the exit looked like, and what the engine last said of itself (pure)."""
    ex = action.exit
    klass = classify_exit(ex.returncode, ex.stderr_tail, killed_for_hang=action.killed_for == "hang")
    sig = exit_signal(ex.returncode)
    inflight = ex.inflight
    last_model = last_health.resident_model if last_health else None
    last_memory = last_health.memory.to_json() if last_health and last_health.memory else None
    return CrashRecord(
        time=ex.ended, klass=klass.value, handled_at=handled_at, pid=ex.pid,
        exit_code=ex.returncode if ex.returncode >= 0 and sig is None else None, signal=signal_name(sig),
        model=(inflight.model if inflight else None) or last_model,
        uptime_s=ex.uptime_s, memory=(inflight.memory if inflight else None) or last_memory,
        request_id=inflight.request_id if inflight else None,
        fingerprint=inflight.fingerprint if inflight else None,
        requests=[{"request_id": rid, "fingerprint": fp} for rid, fp in inflight.all_requests()] if inflight else [],
        stderr_tail="\n".join(ex.stderr_tail.strip().splitlines()[-STDERR_TAIL_LINES:])[-STDERR_TAIL_CHARS:],
        restart_in_s=action.restart_in_s, degraded=action.degraded)


def with_crash_report(record: CrashRecord, report: str, shows_metal_oom: bool) -> CrashRecord:
    """A record completed with macOS's crash report (which can turn an abort
    into a Metal out-of-memory) (pure)."""
    oom = shows_metal_oom and record.klass in (ExitClass.SIGABRT.value, ExitClass.MLX_ERROR.value)
    return replace(record, crash_report=report, klass=ExitClass.METAL_OOM.value if oom else record.klass)


def append_record(path: Path, record: CrashRecord, max_bytes: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.stat().st_size >= max_bytes:
            os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
    line = record.to_line()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(path: Path, include_rotated: bool = True) -> list[CrashRecord]:
    """Every whole record, oldest first; torn or foreign lines are skipped."""
    files = ([path.with_name(path.name + ".1")] if include_rotated else []) + [path]
    records = []
    for f in files:
        try:
            raw = f.read_bytes()
        except OSError:
            continue
        for line in raw.splitlines():
            try:
                rec = CrashRecord.from_json(json.loads(line))
            except ValueError:
                continue
            if rec is not None:
                records.append(rec)
    return records


def crash_counts(records: Iterable[CrashRecord], now: float) -> dict[str, int]:
    """Crashes in the last hour and day (clean stops are not crashes)."""
    crashes = [r for r in records if r.is_crash]
    return {
        "last_hour": sum(1 for r in crashes if now - r.time < 3600),
        "last_day": sum(1 for r in crashes if now - r.time < 86400),
    }


# Exits that say nothing about the requests in flight: kills from outside (the OS's out-of-memory killer's
# SIGKILL; an operator's SIGTERM is a clean stop), exits before any request ran, and a backend's limit (every
# request fails on that model as loaded: the model's, not the request's).
NOT_EVIDENCE = frozenset({"clean_stop", "sigkill", "preload_failed", "config_error"}) | NOT_EXITS
# Signals other than SIGABRT/SIGKILL that a fault raises in the process itself (the rest are sent from outside).
FAULT_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS"})


def is_evidence(record: CrashRecord) -> bool:
    """Whether an exit may blame the requests in flight (pure): a crash the
    engine had (an abort, an MLX error, a hang we killed it for, a fault
    signal), not a kill from outside."""
    if record.klass in NOT_EVIDENCE:
        return False
    if record.klass == "other_signal":
        return record.signal in FAULT_SIGNALS
    return True


def quarantine_verdicts(records: Iterable[CrashRecord], now: float,
                        period_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """(quarantined, suspects): fingerprint -> until (its last crash + the
    period), from the crashes within the period (pure).

    A request is blamed only on evidence: it was alone in flight when the
    engine crashed. Quarantined: alone at two crashes, or alone at one after
    it had been in flight at a crash with others (it crashed the engine again
    when retried alone). Requests that merely shared a batch with a crash are
    never quarantined for it: they are suspects, which the engine decodes
    alone until the period ends, so a retry either clears them or is the
    evidence. Kills from outside never count (`is_evidence`)."""
    crashes = sorted((r for r in records if r.is_crash and is_evidence(r) and now - r.time < period_s),
                     key=lambda r: r.time)
    alone: dict[str, int] = {}  # fingerprint -> crashes with it alone in flight
    shared: set[str] = set()  # fingerprints in flight at a crash with others (so far)
    quarantined: set[str] = set()
    last: dict[str, float] = {}
    for r in crashes:
        fps = r.fingerprints()
        for fp in fps:
            last[fp] = r.time
        if len(fps) == 1:
            (fp,) = fps
            alone[fp] = alone.get(fp, 0) + 1
            if alone[fp] >= 2 or fp in shared:
                quarantined.add(fp)
        else:
            shared |= fps
    suspects = shared - quarantined
    return ({fp: last[fp] + period_s for fp in quarantined}, {fp: last[fp] + period_s for fp in suspects})


def quarantine_list(records: Iterable[CrashRecord], now: float, period_s: float) -> dict[str, float]:
    """The quarantined requests of `quarantine_verdicts` (pure)."""
    return quarantine_verdicts(records, now, period_s)[0]
