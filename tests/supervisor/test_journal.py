"""Crash journal: appends, rotation, torn lines, counts and quarantine."""

import json
import multiprocessing
import os
import signal

from mlxd.supervisor.journal import append_record, crash_counts, quarantine_list, read_records


def test_append_and_read_back(tmp_path):
    j = tmp_path / "crashes.jsonl"
    for i in range(3):
        append_record(j, {"time": 100.0 + i, "class": "sigabrt", "n": i}, max_bytes=10**6)
    assert [r["n"] for r in read_records(j)] == [0, 1, 2]


def test_rotation_keeps_the_previous_file(tmp_path):
    j = tmp_path / "crashes.jsonl"
    for i in range(200):
        append_record(j, {"time": float(i), "class": "sigabrt", "pad": "x" * 100}, max_bytes=5_000)
    assert (tmp_path / "crashes.jsonl.1").exists()
    assert j.stat().st_size < 5_000 + 200
    recs = read_records(j)
    assert recs[-1]["time"] == 199.0 and len(recs) < 200  # older than one rotation are gone


def test_a_torn_last_line_is_skipped(tmp_path):
    j = tmp_path / "crashes.jsonl"
    append_record(j, {"time": 1.0, "class": "sigabrt"}, max_bytes=10**6)
    with j.open("ab") as f:
        f.write(b'{"time": 2.0, "cla')
    assert read_records(j) == [{"time": 1.0, "class": "sigabrt"}]


def _writer(path: str) -> None:
    from pathlib import Path
    i = 0
    while True:
        append_record(Path(path), {"time": float(i), "class": "sigabrt", "pad": "y" * 500}, max_bytes=10**9)
        i += 1


def test_kill_9_mid_append_never_corrupts(tmp_path):
    j = tmp_path / "crashes.jsonl"
    proc = multiprocessing.get_context("spawn").Process(target=_writer, args=(str(j),))
    proc.start()
    try:
        deadline_bytes = 200_000
        import time
        t_end = time.monotonic() + 30
        while (not j.exists() or j.stat().st_size < deadline_bytes) and time.monotonic() < t_end:
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    lines = j.read_bytes().splitlines()
    assert len(lines) > 100
    assert all(json.loads(line)["class"] == "sigabrt" for line in lines)  # every line whole


def test_crash_counts_by_hour_and_day():
    now = 100_000.0
    recs = [{"time": now - 10, "class": "sigabrt"}, {"time": now - 4000, "class": "hang"},
            {"time": now - 90_000, "class": "sigkill"}, {"time": now - 5, "class": "clean_stop"}]
    assert crash_counts(recs, now) == {"last_hour": 1, "last_day": 2}


def test_quarantine_needs_two_crashes_of_the_same_request_within_the_period():
    now = 10_000.0
    recs = [{"time": now - 100, "class": "sigabrt", "fingerprint": "aa"},
            {"time": now - 50, "class": "metal_oom", "fingerprint": "aa"},
            {"time": now - 40, "class": "sigabrt", "fingerprint": "bb"},
            {"time": now - 5000, "class": "sigabrt", "fingerprint": "cc"},
            {"time": now - 10, "class": "sigabrt", "fingerprint": "cc"},
            {"time": now - 9, "class": "sigabrt"}]
    assert quarantine_list(recs, now, period_s=3600) == {"aa": now - 50 + 3600}
