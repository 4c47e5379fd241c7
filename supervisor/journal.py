"""The crash journal: one JSON line per engine exit, in state/crashes.jsonl.

Appends are a single write() of a whole line on an O_APPEND descriptor, so a
kill -9 of the writer at any moment leaves whole records (a torn last line,
should the machine itself die mid-write, is skipped on reading). Rotation
renames the file to crashes.jsonl.1 (atomic) once it passes max_bytes.
Records are mlxd.records.CrashRecord; `crash_record` builds one from the
policy's RecordCrash action (pure), and the readers here are pure over the
records: counts and the quarantine list (`quarantine_list`: the poison
request among those in flight at the crashes).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from mlxd.records import CrashRecord
from mlxd.reports import EngineHealth

from .exit_classes import ExitClass, classify_exit, exit_signal, signal_name
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


def quarantine_list(records: Iterable[CrashRecord], now: float, period_s: float) -> dict[str, float]:
    """fingerprint -> quarantined-until (its last crash + the period), for
    the poison requests among the crashes within the period (pure).

    A crash with one request in flight blames it: two such crashes of one
    fingerprint quarantine it, however far apart (the rule from before the
    engine ran several requests at once). A crash with several in flight
    blames none of them alone: a fingerprint in flight there is quarantined
    only when it was also in flight at the crash just before or just after
    (consecutive crashes, counting every crash in the period, a crash with
    nothing in flight too). So a bystander in flight at one crash, which the
    next crash does not include, is never quarantined. Two requests that
    crash together at two consecutive crashes are both quarantined: the
    journal cannot tell them apart."""
    crashes = sorted((r for r in records if r.is_crash and now - r.time < period_s), key=lambda r: r.time)
    sets = [r.fingerprints() for r in crashes]
    solo: dict[str, int] = {}  # fingerprint -> crashes with it alone in flight
    poison: set[str] = set()
    for i, fps in enumerate(sets):
        if len(fps) == 1:
            (fp,) = fps
            solo[fp] = solo.get(fp, 0) + 1
            if solo[fp] >= 2:
                poison.add(fp)
        if i > 0:
            poison |= fps & sets[i - 1]  # in flight at two crashes in a row
    return {fp: max(r.time for r, fps in zip(crashes, sets) if fp in fps) + period_s for fp in poison}
