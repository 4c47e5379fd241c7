"""Crash journal: appends, rotation, torn lines, counts and quarantine."""

import json
import multiprocessing
import os
import signal

import pytest

from mlxd.records import CrashRecord, ExitRecord, InflightRequest
from mlxd.reports import EngineHealth
from mlxd.supervisor.journal import (append_record, crash_counts, crash_record, is_evidence, quarantine_list,
                                     quarantine_verdicts, read_records, with_crash_report)
from mlxd.supervisor.policy import RecordCrash


def rec(time, klass="sigabrt", **kw):
    return CrashRecord(time=time, klass=klass, **kw)


def test_append_and_read_back(tmp_path):
    j = tmp_path / "crashes.jsonl"
    for i in range(3):
        append_record(j, rec(100.0 + i, pid=i), max_bytes=10**6)
    assert [r.pid for r in read_records(j)] == [0, 1, 2]
    assert json.loads(j.read_bytes().splitlines()[0])["class"] == "sigabrt"  # the file's field name


def test_rotation_keeps_the_previous_file(tmp_path):
    j = tmp_path / "crashes.jsonl"
    for i in range(200):
        append_record(j, rec(float(i), stderr_tail="x" * 100), max_bytes=5_000)
    assert (tmp_path / "crashes.jsonl.1").exists()
    assert j.stat().st_size < 5_000 + 200
    recs = read_records(j)
    assert recs[-1].time == 199.0 and len(recs) < 200  # older than one rotation are gone


def test_a_torn_last_line_is_skipped(tmp_path):
    j = tmp_path / "crashes.jsonl"
    append_record(j, rec(1.0), max_bytes=10**6)
    with j.open("ab") as f:
        f.write(b'{"no": "time"}\n{"time": 2.0, "cla')
    assert read_records(j) == [rec(1.0)]


def _writer(path: str) -> None:
    from pathlib import Path
    i = 0
    while True:
        append_record(Path(path), CrashRecord(time=float(i), klass="sigabrt", stderr_tail="y" * 500),
                      max_bytes=10**9)
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
    recs = [rec(now - 10), rec(now - 4000, "hang"), rec(now - 90_000, "sigkill"), rec(now - 5, "clean_stop")]
    assert crash_counts(recs, now) == {"last_hour": 1, "last_day": 2}


def test_quarantine_needs_two_crashes_of_the_same_request_within_the_period():
    now = 10_000.0
    recs = [rec(now - 100, fingerprint="aa"), rec(now - 50, "metal_oom", fingerprint="aa"),
            rec(now - 40, fingerprint="bb"), rec(now - 5000, fingerprint="cc"), rec(now - 10, fingerprint="cc"),
            rec(now - 9)]
    assert quarantine_list(recs, now, period_s=3600) == {"aa": now - 50 + 3600}


def crash(time, *fps, klass="sigabrt", signal=None):
    """A crash with these fingerprints in flight (request ids r-<fp>), the first the oldest."""
    reqs = [{"request_id": f"r-{fp}", "fingerprint": fp} for fp in fps]
    return rec(time, klass, request_id=reqs[0]["request_id"] if reqs else None,
               fingerprint=fps[0] if fps else None, requests=reqs, signal=signal)


NOW, PERIOD = 10_000.0, 3600.0


@pytest.mark.parametrize("in_flight, quarantined, suspects", [
    # alone in flight at two crashes of one fingerprint, however far apart (as before batching)
    ([("P",), ("P",)], {"P"}, set()),
    ([("P",), ("B",), ("P",)], {"P"}, set()),
    ([("P",), (), ("P",)], {"P"}, set()),
    ([("P",), ("B",)], set(), set()),
    ([("P",)], set(), set()),
    # sharing a batch with a crash is no evidence: a suspect, decoded alone from then on
    ([("P", "B")], set(), {"P", "B"}),
    ([("P", "B"), ("P", "C")], set(), {"P", "B", "C"}),    # four agents and outside aborts: nobody quarantined
    ([("P", "B"), ("P", "B"), ("P", "B")], set(), {"P", "B"}),
    ([("P", "B", "C"), ("D", "P"), ("P", "E")], set(), {"P", "B", "C", "D", "E"}),
    # ... until it crashes the engine again when retried alone: quarantined; the others stay suspects
    ([("P", "B"), ("P",)], {"P"}, {"B"}),
    ([("B", "P"), ("C",), ("P",)], {"P"}, {"B"}),
    ([("P", "B"), ("B", "C"), ("B",)], {"B"}, {"P", "C"}),
    # alone first, then in a batch: one piece of evidence, and a suspect
    ([("P",), ("P", "B")], set(), {"P", "B"}),
    ([("P", "P"), ("P",)], {"P"}, set()),                  # the same request twice in one batch: it was alone
])
def test_quarantine_blames_only_on_evidence(in_flight, quarantined, suspects):
    recs = [crash(NOW - 100 + 10 * i, *fps) for i, fps in enumerate(in_flight)]
    got, suspected = quarantine_verdicts(recs, NOW, PERIOD)
    assert (set(got), set(suspected)) == (quarantined, suspects)
    for fp, until in {**got, **suspected}.items():  # for a period from its last crash
        assert until == max(r.time for r in recs if fp in r.fingerprints()) + PERIOD


@pytest.mark.parametrize("klass, signal, evidence", [
    ("sigabrt", "SIGABRT", True),           # Metal's abort (or one sent from outside: it cannot be told apart)
    ("mlx_error", None, True),
    ("metal_oom", "SIGABRT", True),
    ("hang", "SIGKILL", True),              # alive but not serving: the listener killed it for the request
    ("python_exception", None, True),
    ("other_signal", "SIGSEGV", True),      # a fault in the process itself
    ("sigkill", "SIGKILL", False),          # the OS's out-of-memory killer, or anyone's kill -9
    ("other_signal", "SIGHUP", False),      # sent from outside
    ("clean_stop", "SIGTERM", False),       # an operator's restart
    ("preload_failed", None, False),
    ("config_error", None, False),
])
def test_kills_from_outside_are_no_evidence(klass, signal, evidence):
    assert is_evidence(rec(NOW, klass, signal=signal)) is evidence
    recs = [crash(NOW - 20, "P", klass=klass, signal=signal), crash(NOW - 10, "P", klass=klass, signal=signal)]
    assert set(quarantine_list(recs, NOW, PERIOD)) == ({"P"} if evidence else set())


@pytest.mark.parametrize("in_flight, quarantined", [
    ([("P", 0), ("P", -PERIOD - 1)], set()),              # the earlier crash is out of the period
    ([("P", 0), ("P", 0, "clean_stop")], set()),          # a clean stop is not a crash
    ([("P", 0), ("P", 0, "hang")], {"P"}),                # a hang kill is
])
def test_quarantine_counts_crashes_within_the_period_only(in_flight, quarantined):
    recs = [crash(NOW - 50 + 10 * i + row[1], row[0], klass=row[2] if len(row) > 2 else "sigabrt")
            for i, row in enumerate(in_flight)]
    assert set(quarantine_list(recs, NOW, PERIOD)) == quarantined


def test_quarantine_reads_journal_lines_from_before_batching(tmp_path):
    j = tmp_path / "crashes.jsonl"
    j.write_text("".join(json.dumps({"time": NOW - t, "class": "sigabrt", "request_id": "r", "fingerprint": "fp"})
                         + "\n" for t in (30, 20)))
    append_record(j, crash(NOW - 10, "fp", "other"), max_bytes=10**6)
    assert quarantine_list(read_records(j), NOW, PERIOD) == {"fp": NOW - 10 + PERIOD}


INFLIGHT = InflightRequest(request_id="req-1", fingerprint="fp", model="demo", pid=42, started=99.0,
                           memory={"mlx_active_bytes": 7})
INFLIGHT_BATCH = InflightRequest(request_id="req-1", fingerprint="fp", model="demo", pid=42, started=99.0,
                                 requests=[{"request_id": "req-1", "fingerprint": "fp"},
                                           {"request_id": "req-2", "fingerprint": "fp2"},
                                           {"request_id": "req-3", "fingerprint": "fp3"}])
HEALTH = EngineHealth.from_json({"status": "ok", "resident_model": "other", "memory": {"mlx_active_bytes": 1}})


@pytest.mark.parametrize("exit, killed_for, health, expected", [
    # a SIGABRT mid-request: blamed on the request in flight
    (ExitRecord(returncode=-6, ended=110.0, pid=42, started=100.0, inflight=INFLIGHT), None, HEALTH,
     dict(klass="sigabrt", signal="SIGABRT", exit_code=None, model="demo", request_id="req-1", fingerprint="fp",
          uptime_s=10.0, memory={"mlx_active_bytes": 7},
          requests=[{"request_id": "req-1", "fingerprint": "fp"}])),
    # several requests in flight: every one named, the oldest in request_id/fingerprint as before
    (ExitRecord(returncode=-6, ended=110.0, pid=42, started=100.0, inflight=INFLIGHT_BATCH), None, HEALTH,
     dict(klass="sigabrt", request_id="req-1", fingerprint="fp",
          requests=[{"request_id": "req-1", "fingerprint": "fp"}, {"request_id": "req-2", "fingerprint": "fp2"},
                    {"request_id": "req-3", "fingerprint": "fp3"}])),
    # an exit on an MLX error, idle: the engine's last health fills in
    (ExitRecord(returncode=86, ended=5.0, pid=1, started=4.0), None, HEALTH,
     dict(klass="mlx_error", signal=None, exit_code=86, model="other", request_id=None,
          memory=HEALTH.memory.to_json(), requests=[])),
    # killed for a hang by us: a hang, whatever the signal says
    (ExitRecord(returncode=-9, ended=5.0), "hang", None,
     dict(klass="hang", signal="SIGKILL", exit_code=None, model=None, uptime_s=None)),
    # a Metal message in stderr makes an abort a Metal OOM
    (ExitRecord(returncode=-6, ended=5.0, stderr_tail="[METAL] Command buffer execution failed: Insufficient Memory"),
     None, None, dict(klass="metal_oom")),
])
def test_crash_record_from_the_policys_action(exit, killed_for, health, expected):
    record = crash_record(RecordCrash(exit, 1.0, False, killed_for), health, handled_at=200.0)
    assert record.time == exit.ended and record.handled_at == 200.0 and record.restart_in_s == 1.0
    assert {k: getattr(record, k) for k in expected} == expected


@pytest.mark.parametrize("klass, oom, expected", [
    ("sigabrt", True, "metal_oom"), ("mlx_error", True, "metal_oom"), ("sigabrt", False, "sigabrt"),
    ("sigkill", True, "sigkill"),
])
def test_a_crash_report_can_turn_an_abort_into_a_metal_oom(klass, oom, expected):
    r = with_crash_report(rec(1.0, klass), "x.ips: summary", oom)
    assert r.klass == expected and r.crash_report == "x.ips: summary"


def test_the_journal_line_names_every_request_in_flight(tmp_path):
    exit = ExitRecord(returncode=-6, ended=110.0, pid=42, started=100.0, inflight=INFLIGHT_BATCH)
    j = tmp_path / "crashes.jsonl"
    append_record(j, crash_record(RecordCrash(exit, 1.0, False, None), None, handled_at=200.0), max_bytes=10**6)
    line = json.loads(j.read_bytes())
    assert (line["request_id"], line["fingerprint"]) == ("req-1", "fp")
    assert [(r["request_id"], r["fingerprint"]) for r in line["requests"]] == [
        ("req-1", "fp"), ("req-2", "fp2"), ("req-3", "fp3")]
    assert read_records(j)[0].fingerprints() == {"fp", "fp2", "fp3"}
