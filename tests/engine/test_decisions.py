"""The engine's pure decisions, tested as tables: admission, the one-model
cache plan, stop sequences and fault specs."""

import pytest

from mlxd.engine.admission import AdmissionQueue, AdmissionState, decide_admission, retry_after_s
from mlxd.engine.faults import Fault, parse_faults
from mlxd.engine.model_cache import Load, Unload, plan_release, plan_switch
from mlxd.engine.stop_matcher import StopMatcher


@pytest.mark.parametrize("waiting, running, capacity, accepting, expected", [
    (0, False, 4, True, None),          # idle: admit
    (0, True, 4, True, None),           # busy, room in the line
    (3, True, 4, True, None),
    (4, True, 4, True, 429),            # line full
    (0, False, 0, True, None),          # capacity 0 still admits to an idle worker
    (0, True, 0, True, 429),            # ... but not to a busy one
    (1, False, 1, True, 429),           # someone is already waiting for the idle worker
    (0, False, 4, False, 503),          # draining / restarting
])
def test_admission_table(waiting, running, capacity, accepting, expected):
    err = decide_admission(AdmissionState(waiting, running, capacity, accepting), mean_service_s=2.0)
    assert (err.status if err else None) == expected
    if err is not None:
        assert err.retry_after is not None and err.retry_after >= 1
        assert err.body()["error"]["code"] in ("queue_full", "engine_unavailable")


@pytest.mark.parametrize("waiting, service, expected", [(0, 0.1, 1), (3, 2.0, 8), (100, 10.0, 60)])
def test_retry_after_is_bounded(waiting, service, expected):
    assert retry_after_s(waiting, service) == expected


def test_admission_queue_is_fifo_and_withdraw_frees_the_place():
    q: AdmissionQueue[str] = AdmissionQueue(capacity=2)
    assert q.offer("a") is None
    assert q.take(0) == "a"
    assert q.offer("b") is None and q.offer("c") is None
    assert q.offer("d").status == 429
    assert q.withdraw("b") is True and q.withdraw("b") is False
    assert q.offer("d") is None
    q.done("a", 1.0)
    assert [q.take(0), ] == ["c"]
    q.done("c", 1.0)
    assert q.take(0) == "d"
    q.done("d", 1.0)
    assert q.take(0.01) is None


def test_admission_queue_close_returns_waiters_and_refuses():
    q: AdmissionQueue[str] = AdmissionQueue(capacity=4)
    q.offer("a"), q.offer("b")
    assert q.close() == ["a", "b"]
    assert q.offer("c").status == 503


@pytest.mark.parametrize("resident, wanted, steps", [
    (None, "a", [Load("a")]),
    ("a", "a", []),
    ("a", "b", [Unload("a"), Load("b")]),  # unload strictly before load: never two resident
])
def test_plan_switch(resident, wanted, steps):
    assert plan_switch(resident, wanted) == steps


def test_plan_release():
    assert plan_release(None) == [] and plan_release("a") == [Unload("a")]


@pytest.mark.parametrize("stops, pieces, emitted, stopped", [
    ([], ["ab", "cd"], "abcd", False),
    (["\n\n"], ["ab\n", "\ncd"], "ab", True),                 # stop straddles two pieces
    (["END"], ["xE", "N", "Dy"], "x", True),
    (["END"], ["xE", "N", "x"], "xENx", False),                # a false start is released
    (["END"], ["xEN"], "xEN", False),                          # ... and flushed at the end
    (["ab", "b"], ["xab"], "x", True),                         # earliest match wins
    (["stop"], ["", "st", "", "op"], "", True),
])
def test_stop_matcher(stops, pieces, emitted, stopped):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    assert out == emitted and m.stopped == stopped


@pytest.mark.parametrize("spec, faults", [
    ("abort@token:3", (Fault("abort", "token", 3),)),
    ("hang@start", (Fault("hang", "start", 1),)),
    ("raise@load, abort@idle", (Fault("raise", "load"), Fault("abort", "idle"))),
    ("", ()),
])
def test_parse_faults(spec, faults):
    assert parse_faults(spec) == faults


@pytest.mark.parametrize("spec", ["explode@token", "abort", "abort@nowhere", "abort@token:x"])
def test_parse_faults_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        parse_faults(spec)


@pytest.mark.parametrize("fault, point, tokens, fires", [
    (Fault("abort", "token", 3), "token", 2, False),
    (Fault("abort", "token", 3), "token", 3, True),
    (Fault("abort", "token", 3), "start", 0, False),
    (Fault("raise", "load"), "load", 0, True),
])
def test_fault_fires_at(fault, point, tokens, fires):
    assert fault.fires_at(point, tokens) is fires
