"""A rank group (issue 15, item 3): the engine's model sharded over two
processes with mlx-lm's tensor parallelism, started by `mlx.launch` with the
ring backend on loopback (CPU). Its answers equal a one-process engine's;
under the supervisor a rank's SIGABRT restarts the whole group, journaled
as `sigabrt` like any crash; `mlxd status` shows the group's ranks. The
decisions (the launch command, the group's exit) are tables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import requests

from conftest import engine_toml
from mlxd.config import ConfigError, RanksConfig, parse_config
from mlxd.devkit.engine_process import start_engine
from mlxd.devkit.ports import free_port_run
from mlxd.supervisor.rank_group import group_returncode, launch_argv
from testkit import wait_healthy, wait_until

pytestmark = pytest.mark.timeout(600)
PROMPTS = ["Tokens stream back one by one.", "What is the capital of France?", "Count: one, two,"]


@pytest.mark.parametrize("lines, launcher, expected", [
    # rank 1 aborted; the launcher then SIGTERMed rank 0: the group died of rank 1's SIGABRT
    (["\x1b[33m[WARN] Node with rank 1 exited with code -6 \x1b[0m\n",
      "\x1b[33m[WARN] Node with rank 0 exited with code -15 \x1b[0m\n"], 0, -6),
    (["[WARN] Node with rank 0 exited with code -9\n", "[WARN] Node with rank 1 exited with code -15\n"], 0, -9),
    (["[WARN] Node with rank 1 exited with code 1\n"], 0, 1),  # rank 0 completed: only failures are logged
    (["[WARN] Node with rank 0 exited with code -15\n", "[WARN] Node with rank 1 exited with code -15\n"], 0, -15),
    ([], 0, 0),  # every rank completed: a clean stop
    ([], -9, -9),  # the launcher itself was killed
])
def test_the_groups_exit_is_the_first_ranks_own_failure(lines, launcher, expected):
    assert group_returncode(lines, launcher) == expected


def test_the_launch_command_names_every_rank_and_the_backend():
    ranks = RanksConfig(hosts=["10.0.0.1", "10.0.0.2"], starting_port=40000)
    argv = launch_argv(ranks, "/opt/mlxd/.venv/bin/python")
    assert argv == ["/opt/mlxd/.venv/bin/mlx.launch", "--hosts", "10.0.0.1,10.0.0.2", "--backend", "ring",
                    "--starting-port", "40000"]
    jaccl = launch_argv(RanksConfig(backend="jaccl", hostfile="/etc/mlx/hosts.json"), "/p/bin/python")
    assert jaccl[1:5] == ["--hostfile", "/etc/mlx/hosts.json", "--backend", "jaccl"]


@pytest.mark.parametrize("ranks, problem", [
    ({"hosts": ["10.0.0.1"]}, "two ranks or more"),
    ({"hosts": ["10.0.0.1", "10.0.0.2"], "hostfile": "/h.json"}, "not both"),
    ({"backend": "jaccl", "hosts": ["10.0.0.1", "10.0.0.2"]}, "needs a hostfile"),
])
def test_a_group_that_cannot_be_launched_is_refused(ranks, problem, tmp_path):
    with pytest.raises(ConfigError, match=problem):
        parse_config({"engine": {"ranks": ranks}}, tmp_path)


def group_toml(demo_models, port: int) -> str:
    return engine_toml(demo_models, {"max_tokens_cap": 64,
                                     "ranks": {"hosts": ["127.0.0.1", "127.0.0.1"], "starting_port": port}})


def answers(url: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        for stream in (False, True):
            body = {"model": "demo-a", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                    "temperature": 0, "stream": stream}
            r = requests.post(url + "/v1/chat/completions", json=body, timeout=120, stream=stream)
            assert r.status_code == 200, r.text
            if stream:
                text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                               for line in r.iter_lines() if line.startswith(b"data: {"))
            else:
                text = r.json()["choices"][0]["message"]["content"]
            out.append(text)
    return out


def test_two_ranks_on_loopback_answer_as_one_process_does(shared_engine, tmp_path, demo_models):
    home = tmp_path / "group"
    ring = free_port_run(2)  # rank r binds ring + r
    launcher = launch_argv(parse_config({"engine": {"ranks": {"hosts": ["127.0.0.1", "127.0.0.1"]}}}, home)
                           .engine.ranks, sys.executable)
    launcher[launcher.index("--starting-port") + 1] = str(ring)
    group = start_engine(home, group_toml(demo_models, ring), log_path=home / "group.log", launcher=launcher)
    proc = group.proc
    try:
        wait_healthy(group, 180)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if is_rank(p)]
        assert len(ranks) == 2  # two engine processes: rank 0 serves HTTP, rank 1 follows
        assert answers(group.url) == answers(shared_engine.url)
        assert "rank 0 of a rank group of 2" in group.log() and "rank 1 of 2: following rank 0" in group.log()
        # The launcher killed (as the supervisor does to a hung engine): no rank outlives it.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks), 30,
                   what="the ranks gone with their launcher")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def is_rank(p: psutil.Process) -> bool:
    try:
        return p.cmdline()[1:4] == ["-m", "mlxd.cli", "engine"]  # not mlx.launch's shell around it
    except psutil.Error:  # gone meanwhile
        return False


def rank_pids(st) -> dict[int, int]:
    """rank -> pid of the stack's engine processes (rank 0 listens on the engine port)."""
    runner = json.loads(st.paths.engine_pid.read_text())["runner_pid"]
    procs = [p for p in psutil.Process(runner).children(recursive=True) if is_rank(p)]
    listening = {c.pid for c in psutil.net_connections("inet") if c.laddr and c.laddr.port == st.config.engine.port
                 and c.status == psutil.CONN_LISTEN}
    return {0 if p.pid in listening else 1: p.pid for p in procs}


def test_a_rank_dying_restarts_the_group_and_is_journaled_as_a_crash(stack):
    # A rank group's first forward pass sets up its collectives: on 2 busy cores over the tests' 1 s grace.
    st = stack(engine=f'stuck_grace_s = 10.0\n[engine.ranks]\nhosts = ["127.0.0.1", "127.0.0.1"]\n'
                      f'starting_port = {free_port_run(2)}\n')
    wait_until(lambda: len(rank_pids(st)) == 2, 60, what="two ranks")
    before = rank_pids(st)
    r = requests.post(st.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    os.kill(before[1], signal.SIGABRT)  # the follower, not the rank serving HTTP
    wait_until(lambda: st.records(), 60, what="the crash journaled")
    record = st.records()[-1]
    # The follower's SIGABRT, or rank 0's lost ring when it notices first (a loaded machine): a crash either way.
    assert record.klass in ("sigabrt", "mlx_error"), record
    wait_until(st.healthy, 120, what="the group back")
    after = wait_until(lambda: (p := rank_pids(st)) and len(p) == 2 and p, 60, what="two new ranks")
    assert not set(after.values()) & set(before.values())  # both ranks restarted, as one engine
    status = json.loads(st.mlxd("status", "--json").stdout)
    assert sorted(status["rank_group"]["local_pids"]) == sorted(after.values())
    assert "rank group    2 ranks (ring): 127.0.0.1, 127.0.0.1" in st.mlxd("status").stdout
    r = requests.post(st.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert r.status_code == 200, r.text
