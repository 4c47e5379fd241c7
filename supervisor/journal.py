"""The crash journal: one JSON line per engine exit, in state/crashes.jsonl.

Appends are a single write() of a whole line on an O_APPEND descriptor, so a
kill -9 of the writer at any moment leaves whole records (a torn last line,
should the machine itself die mid-write, is skipped on reading). Rotation
renames the file to crashes.jsonl.1 (atomic) once it passes max_bytes.
Readers here are pure over the records: counts, the last crash, and the
quarantine list (fingerprints in flight in two crashes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable


def append_record(path: Path, record: dict[str, Any], max_bytes: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.stat().st_size >= max_bytes:
            os.replace(path, path.with_name(path.name + ".1"))
    except FileNotFoundError:
        pass
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(path: Path, include_rotated: bool = True) -> list[dict[str, Any]]:
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
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "time" in rec:
                records.append(rec)
    return records


def crash_counts(records: Iterable[dict[str, Any]], now: float) -> dict[str, int]:
    """Crashes in the last hour and day (clean stops are not crashes)."""
    crashes = [r for r in records if r.get("class") != "clean_stop"]
    return {
        "last_hour": sum(1 for r in crashes if now - r["time"] < 3600),
        "last_day": sum(1 for r in crashes if now - r["time"] < 86400),
    }


def quarantine_list(records: Iterable[dict[str, Any]], now: float, period_s: float) -> dict[str, float]:
    """fingerprint -> quarantined-until, for requests in flight in two or
    more crashes within the period (pure)."""
    seen: dict[str, list[float]] = {}
    for r in records:
        fp = r.get("fingerprint")
        if fp and r.get("class") != "clean_stop" and now - r["time"] < period_s:
            seen.setdefault(fp, []).append(r["time"])
    return {fp: max(times) + period_s for fp, times in seen.items() if len(times) >= 2}
