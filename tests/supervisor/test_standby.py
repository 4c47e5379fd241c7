"""The standby engine (supervisor/standby.py, cli/standby.py): a crashed
engine is replaced by a process whose imports are done, and nothing about
crash handling changes. The decisions as tables; the handover with real
supervisord, runner, keeper and engine processes."""

from __future__ import annotations

import os
import signal
import socket

import psutil
import pytest
import requests

from mlxd.records import EnginePid, StandbyFile
from mlxd.standby import Channel, HandoverError
from mlxd.supervisor.standby import STANDBY_BACKOFF_CAP_S, go_message, standby_due
from mlxd.supervisor.supervisord_conf import render_supervisord_conf, stop_timeout_s
from testkit import chat, wait_until

pytestmark = pytest.mark.timeout(240)


# --- decisions -------------------------------------------------------------------
@pytest.mark.parametrize("has_standby, now, quiet_since, delay_s, failures, due", [
    (True, 100.0, 0.0, 10.0, 0, False),     # one is waiting already
    (False, 5.0, 0.0, 10.0, 0, False),      # too soon after the last handover: the engine is starting
    (False, 10.0, 0.0, 10.0, 0, True),
    (False, 15.0, 0.0, 10.0, 1, False),     # one died before it was ready: twice the wait
    (False, 20.0, 0.0, 10.0, 1, True),
    (False, 299.0, 0.0, 10.0, 10, False),   # backed off to the cap, not beyond
    (False, STANDBY_BACKOFF_CAP_S, 0.0, 10.0, 10, True),
    (False, 0.0, 0.0, 0.0, 0, True),        # no delay: at once
    (False, 0.0, 0.0, 0.0, 3, True),        # no delay means no backoff either
])
def test_when_a_standby_is_started(has_standby, now, quiet_since, delay_s, failures, due):
    assert standby_due(has_standby=has_standby, now=now, quiet_since=quiet_since, delay_s=delay_s,
                       failures=failures) is due


GOOD = {"op": "handover", "argv": ["python", "-m", "mlxd.cli", "engine"], "env": {"MLXD_HOME": "/h"}, "cwd": "/"}


@pytest.mark.parametrize("change, ok", [
    ({}, True),
    ({"argv": "python -m mlxd.cli engine"}, False),   # not a list
    ({"argv": ["python", 3]}, False),
    ({"env": {"A": 1}}, False),
    ({"env": None}, False),
    ({"cwd": None}, False),
])
def test_a_handover_becomes_a_go_only_when_well_formed(change, ok):
    go = go_message({**GOOD, **change})
    assert (go is not None) is ok
    if ok:
        assert go == {**GOOD, "op": "go"}


def test_the_channel_carries_messages_and_descriptors_and_says_when_the_other_side_is_gone(tmp_path):
    a, b = socket.socketpair()
    left, right = Channel(a), Channel(b)
    f = (tmp_path / "x").open("w")
    left.send({"n": 1}, [f.fileno()])
    left.send({"n": 2})  # two messages in one read must still come out as two
    msg, fds = right.recv()
    assert msg == {"n": 1} and len(fds) == 1
    os.write(fds[0], b"through the passed descriptor")
    os.close(fds[0])
    f.close()
    assert (tmp_path / "x").read_text() == "through the passed descriptor"
    assert right.recv() == ({"n": 2}, [])
    left.close()
    with pytest.raises(HandoverError):
        right.recv()
    right.close()


def test_the_config_turns_the_standby_on_by_default_and_off_with_ranks(tmp_path):
    from mlxd.config import parse_config

    on = parse_config({}, tmp_path, "x")
    conf = render_supervisord_conf(on)
    assert "[program:standby]" in conf and "engine_runner --standby" in conf
    off = parse_config({"supervisor": {"standby_engine": False}}, tmp_path, "x")
    assert "[program:standby]" not in render_supervisord_conf(off)
    assert "--standby" not in render_supervisord_conf(off)
    assert stop_timeout_s(on) > stop_timeout_s(off)  # the keeper's stop is waited for too
    ranks = parse_config({"engine": {"ranks": {"hosts": ["a", "b"]}}}, tmp_path, "x")
    assert "[program:standby]" not in render_supervisord_conf(ranks)


# --- with real processes -------------------------------------------------------------
FAST_STANDBY = "standby_delay_s = 0\n"


def ready_standby(st) -> StandbyFile:
    wait_until(lambda: (r := StandbyFile.read(st.paths.standby)) is not None and r.ready, 60,
               what="a standby engine ready")
    record = StandbyFile.read(st.paths.standby)
    assert record is not None
    return record


def test_a_crashed_engine_is_replaced_by_the_standby_and_the_crash_is_classified_as_before(stack):
    st = stack(supervisor=FAST_STANDBY)
    standby = ready_standby(st)
    first = st.engine_pid()
    assert not EnginePid.read(st.paths.engine_pid).from_standby  # the first engine started afresh
    st.fault_file.write_text("abort@token:2")
    with pytest.raises(requests.RequestException):
        chat(st.url, max_tokens=20)
    st.fault_file.unlink()
    wait_until(lambda: st.engine_pid() not in (None, first) and st.healthy(), 60, what="the engine back")
    record = EnginePid.read(st.paths.engine_pid)
    assert record.pid == standby.pid and record.from_standby  # the waiting process took over
    crash = st.records()[-1]
    assert crash.klass == "sigabrt" and crash.signal == "SIGABRT" and crash.pid == first and crash.request_id
    answer = chat(st.url, max_tokens=5)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    # The adopted engine's own crash is seen through the keeper, its parent: classified, journaled, replaced.
    next_standby = ready_standby(st)
    assert next_standby.pid not in (standby.pid, None) and next_standby.handovers == 1
    st.fault_file.write_text("abort@idle")
    wait_until(lambda: len(st.records()) == 2, 30, what="the adopted engine's crash journaled")
    st.fault_file.unlink()
    assert st.records()[-1].klass == "sigabrt" and st.records()[-1].pid == standby.pid
    wait_until(lambda: st.engine_pid() == next_standby.pid and st.healthy(), 60, what="the next standby serving")
    assert "taken over from a standby" in st.paths.engine_stderr.read_text()


def test_an_engine_whose_runner_is_killed_does_not_outlive_it(stack):
    st = stack(supervisor=FAST_STANDBY)
    ready_standby(st)
    first = st.engine_pid()
    os.kill(first, signal.SIGABRT)
    wait_until(lambda: st.engine_pid() not in (None, first) and st.healthy(), 60, what="the standby serving")
    adopted = EnginePid.read(st.paths.engine_pid)
    assert adopted.from_standby
    engine = psutil.Process(adopted.pid)
    os.kill(adopted.runner_pid, signal.SIGKILL)  # as supervisord's killasgroup would
    engine.wait(15)  # the keeper saw its runner go and killed the engine: no second engine on the port
    wait_until(lambda: st.engine_pid() not in (None, adopted.pid) and st.healthy(), 60, what="an engine again")


def test_an_operator_restart_starts_afresh_and_replaces_the_standby(stack):
    st = stack(supervisor=FAST_STANDBY)
    standby = ready_standby(st)
    restart = st.mlxd("restart", "engine")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    record = EnginePid.read(st.paths.engine_pid)
    assert not record.from_standby and record.pid != standby.pid  # new code and config are read afresh
    assert not psutil.pid_exists(standby.pid) or psutil.Process(standby.pid).status() == psutil.STATUS_ZOMBIE
    assert ready_standby(st).pid != standby.pid


def test_down_leaves_no_engine_and_no_standby(stack):
    st = stack(supervisor=FAST_STANDBY)
    standby = ready_standby(st)
    engine = st.engine_pid()
    down = st.mlxd("down")
    assert down.returncode == 0, down.stdout + down.stderr
    for pid in (standby.pid, standby.keeper_pid, engine):
        wait_until(lambda p=pid: not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE,
                   15, what=f"pid {pid} gone")
    assert not st.paths.standby_socket.exists()


def test_without_a_standby_the_runner_starts_the_engine_itself(stack):
    st = stack(supervisor="standby_engine = false\n")
    assert st.process_pid("standby") is None
    first = st.engine_pid()
    os.kill(first, signal.SIGABRT)
    wait_until(lambda: st.engine_pid() not in (None, first) and st.healthy(), 60, what="the engine back")
    assert not EnginePid.read(st.paths.engine_pid).from_standby
    assert st.records()[-1].klass == "sigabrt"
