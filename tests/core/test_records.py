"""Records between processes: what one writes, the other reads back; what
is not a record (missing, torn, foreign, older) reads as None, never raises."""

import json

import pytest

from mlxd.records import (CrashRecord, EngineExit, EnginePid, ExitRecord, InflightRequest, Quarantine,
                          SupervisionFile)

INFLIGHT = INFLIGHT_ONE = InflightRequest(request_id="r", fingerprint="f", model="m", pid=1, started=2.0,
                                          memory={"a": 1})
BATCH = [{"request_id": "r", "fingerprint": "f"}, {"request_id": "r2", "fingerprint": "g"}]
INFLIGHT_BATCH = InflightRequest(request_id="r", fingerprint="f", model="m", pid=1, started=2.0, requests=BATCH)

ROUND_TRIPS = [
    EnginePid(pid=10, runner_pid=9, started=1.5),
    EngineExit(pid=10, runner_pid=9, returncode=-6, started=1.5, ended=3.0),
    INFLIGHT,
    INFLIGHT_BATCH,
    ExitRecord(returncode=86, ended=3.0, pid=10, inflight=INFLIGHT),
    ExitRecord(returncode=-6, ended=3.0, pid=10, inflight=INFLIGHT_BATCH),
    CrashRecord(time=3.0, klass="sigabrt", fingerprint="f", memory={"a": 1}),
    CrashRecord(time=3.0, klass="sigabrt", request_id="r", fingerprint="f", requests=BATCH),
    Quarantine({"f": 99.0}),
    SupervisionFile(state={"mode": "running", "consecutive": 2}, listener_pid=5, updated=4.0, supervisord_pid=3),
]


@pytest.mark.parametrize("record", ROUND_TRIPS, ids=lambda r: type(r).__name__)
def test_written_records_read_back_equal(record, tmp_path):
    path = tmp_path / "rec.json"
    record.write(path)
    assert type(record).read(path) == record


@pytest.mark.parametrize("cls, data", [
    (EnginePid, None),                                  # no file
    (EnginePid, [1, 2]),                                # not an object
    (EnginePid, {"pid": 1, "started": 2.0}),            # a required field missing
    (EngineExit, {"pid": 1, "runner_pid": 2, "returncode": None, "started": 1, "ended": 2}),
    (InflightRequest, {"request_id": "r"}),
    (CrashRecord, {"class": "sigabrt"}),                # no time
    (SupervisionFile, {"mode": "running"}),             # no writer
])
def test_what_is_not_a_record_reads_as_none(cls, data):
    assert cls.from_json(data) is None


def test_unknown_fields_are_ignored_and_missing_optional_ones_defaulted():
    r = CrashRecord.from_json({"time": 1.0, "class": "hang", "from_a_newer_mlxd": True})
    assert r == CrashRecord(time=1.0, klass="hang")


def test_the_journal_field_is_still_called_class():
    assert CrashRecord(time=1.0, klass="hang").to_json()["class"] == "hang"


def test_the_supervision_file_keeps_the_state_flat():
    data = SupervisionFile(state={"mode": "degraded"}, listener_pid=5, updated=1.0).to_json()
    assert data["mode"] == "degraded" and data["listener_pid"] == 5


def test_an_exit_record_nests_its_inflight_request():
    back = ExitRecord.from_json(ExitRecord(returncode=-6, ended=2.0, started=1.0, inflight=INFLIGHT).to_json())
    assert back.inflight == INFLIGHT and back.uptime_s == 1.0


def test_quarantine_active_drops_expired_entries():
    assert Quarantine({"a": 10.0, "b": 5.0}).active(now=6.0) == {"a": 10.0}


OLD_INFLIGHT_FILE = {"request_id": "r", "fingerprint": "f", "model": "m", "pid": 1, "started": 2.0,
                     "memory": {"a": 1}}  # what an engine before batching wrote


@pytest.mark.parametrize("data, want", [
    (OLD_INFLIGHT_FILE, (("r", "f"),)),                                          # no `requests`: the one
    ({**OLD_INFLIGHT_FILE, "requests": []}, (("r", "f"),)),                      # empty: the one
    ({**OLD_INFLIGHT_FILE, "requests": BATCH}, (("r", "f"), ("r2", "g"))),       # every one, oldest first
    ({**OLD_INFLIGHT_FILE, "requests": BATCH[1:]}, (("r", "f"), ("r2", "g"))),   # its own left out: it leads
    ({**OLD_INFLIGHT_FILE, "requests": "junk"}, (("r", "f"),)),                  # foreign values are skipped
    ({**OLD_INFLIGHT_FILE, "requests": [1, {"request_id": "x"}, BATCH[1]]}, (("r", "f"), ("r2", "g"))),
])
def test_inflight_names_every_request_and_an_old_file_still_reads(data, want, tmp_path):
    path = tmp_path / "engine.inflight.json"
    path.write_text(json.dumps(data))
    r = InflightRequest.read(path)
    assert r is not None and (r.request_id, r.fingerprint, r.memory) == ("r", "f", {"a": 1})
    assert r.all_requests() == want
    if "requests" not in data:
        assert r == INFLIGHT_ONE


@pytest.mark.parametrize("data, in_flight, fingerprints", [
    ({"time": 1.0, "class": "sigabrt"}, (), frozenset()),                                 # nothing in flight
    ({"time": 1.0, "class": "sigabrt", "request_id": "r", "fingerprint": "f"},            # an older journal line
     (("r", "f"),), frozenset({"f"})),
    ({"time": 1.0, "class": "sigabrt", "request_id": "r", "fingerprint": "f", "requests": BATCH},
     (("r", "f"), ("r2", "g")), frozenset({"f", "g"})),
])
def test_a_crash_record_names_what_was_in_flight(data, in_flight, fingerprints):
    r = CrashRecord.from_json(data)
    assert r.in_flight() == in_flight and r.fingerprints() == fingerprints
