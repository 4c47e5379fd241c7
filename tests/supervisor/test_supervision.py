"""Crash-aware supervision end to end: real supervisord, the real engine
with fault injection, our runner and listener, in a temporary state dir."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import requests

from mlxd.records import Quarantine
from testkit import chat, wait_until

pytestmark = pytest.mark.timeout(240)
def test_sigabrt_mid_generation_is_journaled_and_the_engine_comes_back(stack):
    st = stack(fault="abort@token:3")
    first_pid = st.engine_pid()
    with pytest.raises(requests.RequestException):
        chat(st.url, max_tokens=50)
    st.fault_file.unlink()
    wait_until(lambda: st.records(), 30, what="a journal record")
    rec = st.records()[-1]
    assert rec.klass == "sigabrt" and rec.signal == "SIGABRT" and rec.pid == first_pid
    assert rec.request_id and rec.fingerprint and rec.model == "demo-a"
    assert rec.uptime_s > 0 and rec.memory["mlx_active_bytes"] > 0
    assert rec.restart_in_s == 0.0  # the first crash after a run restarts at once
    wait_until(st.healthy, 60, what="engine healthy again")
    assert st.engine_pid() != first_pid
    assert chat(st.url).status_code == 200
    status = st.status()
    assert status["overall"] == "healthy" and status["crashes"]["last_hour"] == 1
    assert status["crashes"]["last"]["class"] == "sigabrt"


def test_metal_oom_message_in_stderr_is_classified_metal_oom(stack):
    st = stack(fault="oom@token:2")
    with pytest.raises(requests.RequestException):
        chat(st.url, max_tokens=50)
    st.fault_file.unlink()
    wait_until(lambda: st.records(), 30, what="a journal record")
    rec = st.records()[-1]
    assert rec.klass == "metal_oom" and rec.signal == "SIGABRT"
    assert "kIOGPUCommandBufferCallbackErrorOutOfMemory" in rec.stderr_tail
    wait_until(st.healthy, 60, what="engine healthy again")


def test_crash_loop_backs_off_then_degrades_stays_quiet_and_recovers(stack):
    # A 1 s base: the growing waits (0, 1, 2 s) stand out of a loaded machine's boot-time noise.
    st = stack(supervisor="loop_crashes = 4\ncooldown_s = 6\nhealthy_reset_s = 60\nbackoff_base_s = 1.0",
               fault="abort@boot")
    wait_until(lambda: st.supervision().get("mode") == "degraded", 90, what="degraded after the crash loop")
    recs = st.records()
    assert [r.klass for r in recs] == ["sigabrt"] * 4
    assert [r.restart_in_s for r in recs] == [0.0, 1.0, 2.0, None]  # growing backoff, then none
    assert recs[-1].degraded is True
    gaps = [b.time - a.time for a, b in zip(recs, recs[1:])]
    assert gaps[2] > gaps[0] + 1.0  # the waits grew between crashes
    assert st.status()["overall"] == "degraded"
    # During the cool-down: no restarts, and supervisord + listener stay idle.
    procs = [psutil.Process(int(st.paths.supervisord_pid.read_text())), psutil.Process(st.process_pid("crashwatch"))]
    cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
    t0 = time.monotonic()
    wait_until(lambda: time.monotonic() - t0 > 3, 5, interval=0.5, what="3 s of cool-down")
    cpu = sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0
    assert len(st.records()) == 4 and st.supervision()["mode"] == "degraded"
    assert cpu < 0.5, f"supervisord + listener used {cpu:.2f}s CPU in 3s of cool-down"
    # Fixed meanwhile: after the cool-down one probation start succeeds.
    st.fault_file.unlink()
    wait_until(st.healthy, 60, what="recovery after the cool-down")
    assert len(st.records()) == 4


def test_explicit_restart_ends_a_crash_loop_at_once(stack):
    st = stack(supervisor="loop_crashes = 2\ncooldown_s = 600", fault="abort@boot")
    wait_until(lambda: st.supervision().get("mode") == "degraded", 60, what="degraded")
    st.fault_file.unlink()
    r = st.mlxd("restart", "engine")
    assert r.returncode == 0, r.stderr
    assert st.healthy() and st.supervision()["mode"] == "running"
    # It went through the policy as the operator's event, not by inference:
    listener_log = (st.paths.logs / "listener.log").read_text()
    assert "engine supervision: degraded -> starting (OperatorRestart)" in listener_log
    assert st.supervision()["crash_times"] == []


def test_hang_is_killed_and_restarted_within_the_deadline(stack):
    st = stack(engine="stuck_grace_s = 1.0\n", fault="hang@token:2")
    first_pid = st.engine_pid()
    t0 = time.monotonic()
    try:  # the engine's own 503 and the listener's kill race: either ends the request
        r = chat(st.url, max_tokens=50)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stuck"
    except requests.ConnectionError:
        pass
    st.fault_file.unlink()
    wait_until(lambda: st.records(), 30, what="a journal record")
    detected = time.monotonic() - t0
    rec = st.records()[-1]
    assert rec.klass == "hang" and rec.pid == first_pid
    assert detected < 1.0 + 5  # stuck_grace_s + a few seconds
    wait_until(st.healthy, 60, what="engine healthy again")
    assert chat(st.url).status_code == 200


def test_a_request_that_crashes_twice_is_quarantined_and_others_are_served(stack):
    st = stack(env={"MLXD_FAULT_MATCH": "poison"}, fault="abort@token:2")
    poison = "please process this poison payload"
    for crash in (1, 2):
        with pytest.raises(requests.RequestException):
            chat(st.url, content=poison, max_tokens=20)
        wait_until(lambda: len(st.records()) == crash, 30, what=f"crash {crash} journaled")
        wait_until(st.healthy, 60, what="engine back")
    fps = {r.fingerprint for r in st.records()}
    assert len(fps) == 1
    wait_until(lambda: st.paths.quarantine.exists(), 10, what="quarantine list written")
    r = chat(st.url, content=poison, max_tokens=20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_quarantined"
    assert chat(st.url, content="an ordinary question", max_tokens=5).status_code == 200
    assert st.status()["quarantined_requests"] == 1


def test_a_crash_in_a_batch_blames_nobody_until_a_retry_alone_crashes_again(stack):
    """Two requests in one batch when the engine aborts: neither is quarantined for it; both are suspects,
    decoded alone from then on; the bystander, retried, is served; the poison one, retried alone, crashes
    the engine again and is quarantined (issue 36: quarantine that blames only the guilty)."""
    st = stack(engine="max_concurrency = 2\nbatching = \"always\"\n", env={"MLXD_FAULT_MATCH": "poison"}, fault="abort@token:6")
    poison, bystander = "please process this poison payload", "an ordinary question, asked at length"
    body = {"model": "default", "messages": [{"role": "user", "content": bystander}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    with requests.post(st.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as first:
        lines = first.iter_lines()
        wait_until(lambda: next(lines).startswith(b"data: {"), 30, interval=0, what="the bystander decoding")
        with pytest.raises(requests.RequestException):  # joins the batch, and the engine aborts at its 6th token
            chat(st.url, content=poison, max_tokens=20)
    wait_until(lambda: len(st.records()) == 1, 30, what="the crash journaled")
    assert len(st.records()[0].fingerprints()) == 2  # both were in flight
    wait_until(st.healthy, 60, what="engine back")
    wait_until(lambda: st.paths.quarantine.exists(), 10, what="the verdicts written")
    verdicts = Quarantine.read(st.paths.quarantine)
    assert verdicts is not None and not verdicts.fingerprints and len(verdicts.suspects) == 2
    assert (st.status()["quarantined_requests"], st.status()["suspected_requests"]) == (0, 2)

    assert chat(st.url, content=bystander, max_tokens=5).status_code == 200  # a suspect is served
    with pytest.raises(requests.RequestException):  # alone this time: the evidence
        chat(st.url, content=poison, max_tokens=20)
    wait_until(lambda: len(st.records()) == 2, 30, what="the second crash journaled")
    assert len(st.records()[1].fingerprints()) == 1
    wait_until(st.healthy, 60, what="engine back")
    wait_until(lambda: (Quarantine.read(st.paths.quarantine) or Quarantine()).fingerprints, 10,
               what="the poison request quarantined")
    r = chat(st.url, content=poison, max_tokens=20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_quarantined"
    assert chat(st.url, content=bystander, max_tokens=5).status_code == 200
    assert "was in flight at a crash with others: decoded alone" in st.log_tail(400)


def test_kill_9_of_the_listener_is_survived(stack):
    st = stack()
    engine_pid = st.engine_pid()
    old = st.process_pid("crashwatch")
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: (p := st.process_pid("crashwatch")) and p != old, 30, what="listener restarted")
    assert st.engine_pid() == engine_pid and st.healthy()  # the engine was not touched
    st.fault_file.write_text("abort@idle")  # and crashes are still handled
    wait_until(lambda: st.records(), 30, what="crash journaled by the new listener")
    st.fault_file.unlink()
    wait_until(st.healthy, 60, what="engine back")


def test_kill_9_of_supervisord_leaves_nothing_that_blocks_the_next_start(stack):
    st = stack()
    sup = int(st.paths.supervisord_pid.read_text())
    engine = psutil.Process(st.engine_pid())
    os.kill(sup, signal.SIGKILL)
    engine.wait(15)  # the runner noticed and stopped the orphaned engine
    wait_until(lambda: not st.healthy(), 10, what="port released")
    up = st.mlxd("up", "--detach", "--timeout", "90")
    assert up.returncode == 0, up.stderr + up.stdout
    assert st.healthy() and int(st.paths.supervisord_pid.read_text()) != sup
