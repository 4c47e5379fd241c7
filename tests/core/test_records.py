"""Records between processes: what one writes, the other reads back; what
is not a record (missing, torn, foreign, older) reads as None, never raises.
Reports (/health, `mlxd status`) read tolerantly: an older or newer mlxd's
answer still reads, its unknown keys dropped, missing or mistyped ones defaulted."""

import json
from typing import Any

import pytest

from mlxd.records import (CrashRecord, EngineExit, EnginePid, ExitRecord, InflightRequest, Quarantine, StartedWith,
                          SupervisionFile, fits)
from mlxd.reports import (CrashCounts, EngineHealth, EngineMemory, EngineProbe, ForeignListener, GatewayProbe,
                          HostProbe, KVCacheLayout, LastCrash, OllamaProbe, ProcessInfo, PromptCacheReport, RankGroup,
                          ReuseLine, ServingPlanReport, StatusReport, SupervisordState)

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
    Quarantine({"f": 99.0}, suspects={"g": 98.0}),
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


# --- reports: the engine's /health and `mlxd status` ------------------------------

WIRE_KEYS = {"status", "reason", "worker_alive", "phase", "resident_model", "kv_cache", "tools", "embedding_model", "reranker_model", "in_flight",
             "in_flight_fingerprint", "running", "batch_size", "requests", "max_concurrency", "serving", "queue_depth", "queue_capacity",
             "max_observed_concurrency", "memory", "counters", "prompt_cache", "timings", "keep_alive_s",
             "unload_in_s", "unloaded_idle_at", "unloaded_idle_model", "uptime_s", "process_started_at", "ready_at", "pid"}

HEALTH = EngineHealth(
    status="ok", worker_alive=True, phase="decode", resident_model="demo", kv_cache=KVCacheLayout(bits=8),
    in_flight="r1", in_flight_fingerprint="f1", running=["r1", "r2"], batch_size=2, max_concurrency=4,
    serving=ServingPlanReport(model="demo", max_concurrency=4, decoder="batch"),
    queue_depth=1, queue_capacity=16, max_observed_concurrency=3,
    memory=EngineMemory(mlx_active_bytes=5, mlx_peak_bytes=6, rss_bytes=7, budget_bytes=8,
                        mlx_active_before_first_load=1),
    counters={"model_loads": 1}, timings={"last_load_s": 0.5},
    prompt_cache=PromptCacheReport(enabled=True, hits=1, requests=2, hit_rate=0.25,
                                   recent=[ReuseLine(conversation="c1", prompt_tokens=10, cached_tokens=4,
                                                     stopped_at=4, why="the system prompt changed")]),
    uptime_s=12.5, process_started_at=100.0, ready_at=101.5, pid=42)

STATUS = StatusReport(
    time=200.0, home="/h", overall="healthy", supervisord=SupervisordState(running=True, pid=9),
    engine=EngineProbe(url="http://e/health", http_status=200, health=HEALTH),
    crashes=CrashCounts(last_hour=1, last_day=2, last=LastCrash(time=150.0, klass="sigabrt", signal="SIGABRT")),
    processes=[ProcessInfo(name="engine", state="RUNNING", pid=42, uptime_s=3.0, description="pid 42")],
    gateway=GatewayProbe(url="http://g/mlxd/health", http_status=200, health={"status": "ok", "pid": 8}),
    supervision=SupervisionFile(state={"mode": "running"}, listener_pid=5, updated=1.0, supervisord_pid=9),
    quarantined_requests=1, ollama=OllamaProbe(url="http://o", reachable=True, version="0.5"),
    hosts=[HostProbe(url="http://other:8001", http_status=503, health=EngineHealth(status="loading"),
                     models=["big"])],
    rank_group=RankGroup(backend="ring", hosts=["a", "b"], local_pids=[1, 2]),
    foreign_listeners=[ForeignListener(port=8000, used_for="engine", pid=77, cmdline="python x")],
    autostart={"kind": "systemd", "detail": "not installed"},
    started_with=StartedWith(config="/h/mlxd.toml", engine_host="127.0.0.1", engine_port=1, gateway_host="127.0.0.1",
                             gateway_port=2, ollama_url="http://o"))


@pytest.mark.parametrize("report", [HEALTH, EngineHealth(status="loading"), STATUS,
                                    StatusReport(time=1.0, home="/h", overall="down",
                                                 supervisord=SupervisordState(running=False),
                                                 engine=EngineProbe(url="http://e/health"))],
                         ids=["health", "health_minimal", "status", "status_down"])
def test_reports_read_back_equal_through_json_text(report):
    assert type(report).from_json(json.loads(json.dumps(report.to_json()))) == report


def test_health_on_the_wire_keeps_its_keys():
    body = HEALTH.to_json()
    assert set(body) == WIRE_KEYS
    assert body["kv_cache"] == {"bits": 8, "group_size": 64, "quantized_start": 0, "coarse_steps": False}
    assert body["serving"]["decoder"] == "batch" and body["serving"]["max_concurrency"] == 4
    assert EngineHealth.from_json(body).serving == HEALTH.serving  # read back whole
    assert body["prompt_cache"]["recent"][0]["conversation"] == "c1" and body["memory"]["mlx_peak_bytes"] == 6


def test_status_json_keeps_its_keys():
    data = STATUS.to_json()
    assert data["crashes"]["last"]["class"] == "sigabrt" and data["foreign_listeners"][0]["for"] == "engine"
    assert data["supervision"]["mode"] == "running"  # the supervision file, flat as on disk
    assert data["engine"]["health"]["pid"] == 42 and data["started_with"]["engine_port"] == 1


@pytest.mark.parametrize("body, expected", [
    # an engine from before batching: no running, kv_cache or prompt_cache
    ({"status": "ok", "in_flight": "r1", "memory": {"mlx_active_bytes": 5}},
     EngineHealth(status="ok", in_flight="r1", memory=EngineMemory(mlx_active_bytes=5))),
    # a newer engine: keys and nested keys we do not know are dropped
    ({"status": "ok", "pid": 3, "gpu_watts": 40, "memory": {"rss_bytes": 7, "swap_bytes": 1}},
     EngineHealth(status="ok", pid=3, memory=EngineMemory(rss_bytes=7))),
    # values of the wrong type read as missing (their defaults)
    ({"status": "ok", "pid": "3", "running": "r1", "batch_size": True, "memory": "lots", "counters": {"x": "y"}},
     EngineHealth(status="ok")),
    ({"status": "ok", "running": ["r1", 2], "kv_cache": {"bits": "8"}, "uptime_s": 3},
     EngineHealth(status="ok", kv_cache=KVCacheLayout(), uptime_s=3)),
    # a recent-reuse line without its conversation is skipped, the rest kept
    ({"status": "ok", "prompt_cache": {"enabled": True, "recent": [{"why": "?"}, {"conversation": "c"}, 5]}},
     EngineHealth(status="ok", prompt_cache=PromptCacheReport(enabled=True, recent=[ReuseLine(conversation="c")]))),
    # not an engine's report at all
    (None, None), ([], None), ({}, None), ({"pid": 3}, None), ({"status": 200}, None),
])
def test_health_from_another_mlxd_reads_tolerantly(body, expected):
    assert EngineHealth.from_json(body) == expected


@pytest.mark.parametrize("body, kv_bits, load_s", [
    ({"status": "ok"}, 16, None),
    ({"status": "ok", "kv_cache": {"bits": 4, "group_size": 32, "quantized_start": 0}}, 4, None),
    ({"status": "ok", "process_started_at": 100.0, "ready_at": 101.25}, 16, 1.25),
])
def test_health_derived_figures(body, kv_bits, load_s):
    h = EngineHealth.from_json(body)
    assert (h.kv_bits, h.load_s) == (kv_bits, load_s)


def test_a_status_part_that_does_not_read_is_its_default():
    data = {**STATUS.to_json(), "hosts": [{"url": "http://x", "health": {"pid": 1}}, "junk"], "crashes": "none",
            "rank_group": {"hosts": ["a"]}}
    st = StatusReport.from_json(data)
    assert st.hosts == [HostProbe(url="http://x")] and st.crashes == CrashCounts() and st.rank_group is None


@pytest.mark.parametrize("value, hint, fits_it", [
    (1, int, True), (True, int, False), (1, float, True), (1.5, int, False), ("a", str | None, True),
    (None, str | None, True), (None, str, False), (["a"], list[str], True), (["a", 1], list[str], False),
    ({"a": 1}, dict[str, int], True), ({"a": 1.5}, dict[str, int], False), ({"a": [1]}, dict[str, Any], True),
    ("x", Any, True),
])
def test_fits(value, hint, fits_it):
    assert fits(value, hint) is fits_it
