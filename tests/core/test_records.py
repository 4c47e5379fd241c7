"""Records between processes: what one writes, the other reads back; what
is not a record (missing, torn, foreign, older) reads as None, never raises."""

import pytest

from mlxd.records import (CrashRecord, EngineExit, EnginePid, ExitRecord, InflightRequest, Quarantine,
                          SupervisionFile)

INFLIGHT = InflightRequest(request_id="r", fingerprint="f", model="m", pid=1, started=2.0, memory={"a": 1})

ROUND_TRIPS = [
    EnginePid(pid=10, runner_pid=9, started=1.5),
    EngineExit(pid=10, runner_pid=9, returncode=-6, started=1.5, ended=3.0),
    INFLIGHT,
    ExitRecord(returncode=86, ended=3.0, pid=10, inflight=INFLIGHT),
    CrashRecord(time=3.0, klass="sigabrt", fingerprint="f", memory={"a": 1}),
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
