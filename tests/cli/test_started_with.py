"""What `mlxd up` started with, and which value a later command uses: a
variable set now, else what `up` started with, else mlxd.toml (tables of
cases; the commands against a real stack are in tests/ops/test_started_with.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from mlxd.cli import started_with
from mlxd.cli.status_format import format_started_with
from mlxd.config import parse_config
from mlxd.paths import StatePaths
from mlxd.records import StartedWith

# `up` was given a config file and both ports; the hosts and the Ollama URL came from mlxd.toml.
RECORD = StartedWith(config="/etc/mlxd/custom.toml", engine_host="127.0.0.1", engine_port=14001,
                     gateway_host="0.0.0.0", gateway_port=14000, ollama_url="http://127.0.0.1:11434",
                     env={"MLXD_CONFIG": "/etc/mlxd/custom.toml", "MLXD_ENGINE_PORT": "14001",
                          "MLXD_GATEWAY_PORT": "14000"}, up_pid=123, started=1.0)
EVERY_VALUE = {"MLXD_CONFIG": "/etc/mlxd/custom.toml", "MLXD_ENGINE_HOST": "127.0.0.1", "MLXD_ENGINE_PORT": "14001",
               "MLXD_GATEWAY_HOST": "0.0.0.0", "MLXD_GATEWAY_PORT": "14000",
               "MLXD_OLLAMA_URL": "http://127.0.0.1:11434"}


@pytest.mark.parametrize("now, record, purpose, expected", [
    # nothing remembered: only what is set now (then mlxd.toml)
    ({}, None, "reach", {}),
    ({"MLXD_GATEWAY_PORT": "5000", "PATH": "/bin"}, None, "reach", {"MLXD_GATEWAY_PORT": "5000"}),
    # reaching the running stack: every value `up` resolved ...
    ({}, RECORD, "reach", EVERY_VALUE),
    # ... unless set now: an explicit variable wins, one by one
    ({"MLXD_GATEWAY_PORT": "5000"}, RECORD, "reach", {**EVERY_VALUE, "MLXD_GATEWAY_PORT": "5000"}),
    ({"MLXD_CONFIG": "/tmp/other.toml", "MLXD_OLLAMA_URL": "http://o:1"}, RECORD, "reach",
     {**EVERY_VALUE, "MLXD_CONFIG": "/tmp/other.toml", "MLXD_OLLAMA_URL": "http://o:1"}),
    # starting again (`restart all`): only what `up` was given, so an edited mlxd.toml applies
    ({}, RECORD, "start", RECORD.env),
    ({"MLXD_ENGINE_PORT": "9000"}, RECORD, "start", {**RECORD.env, "MLXD_ENGINE_PORT": "9000"}),
    ({"MLXD_ENGINE_HOST": "::1"}, RECORD, "start", {**RECORD.env, "MLXD_ENGINE_HOST": "::1"}),
    # a remembered variable that is not an override (a foreign file) is not carried
    ({}, StartedWith(**{**RECORD.to_json(), "env": {"MLXD_FAULT": "abort@boot"}}), "start", {}),
])
def test_which_value_wins(now, record, purpose, expected):
    assert started_with.overrides_for(now, record, purpose) == expected


def test_what_up_remembers_is_what_it_resolved_and_was_given(tmp_path):
    env = {"MLXD_ENGINE_PORT": "14001", "MLXD_FAULT": "abort@boot", "HOME": "/root"}
    config = parse_config({"engine": {"port": 14001}, "gateway": {"host": "0.0.0.0", "port": 4000}}, tmp_path)
    record = started_with.started_with(config, tmp_path / "mlxd.toml", env, up_pid=7, now=2.0)
    assert (record.engine_host, record.engine_port, record.gateway_host, record.gateway_port) == \
           ("127.0.0.1", 14001, "0.0.0.0", 4000)
    assert record.config == str(tmp_path / "mlxd.toml") and record.env == {"MLXD_ENGINE_PORT": "14001"}
    assert parse_config({}, tmp_path).gateway.ollama_url == record.ollama_url


def test_the_remembered_values_load_as_the_same_config(tmp_path):
    from mlxd.config import apply_env_overrides

    config = parse_config(apply_env_overrides({}, started_with.resolved_overrides(RECORD)), tmp_path)
    assert (config.engine.port, config.gateway.port, config.gateway.host) == (14001, 14000, "0.0.0.0")
    assert config.gateway_url == "http://127.0.0.1:14000"


@pytest.mark.parametrize("text", [
    "",                                                       # torn
    "not json",
    json.dumps({**RECORD.to_json(), "engine_port": "14001"}),  # a port that is not a number
    json.dumps({**RECORD.to_json(), "engine_port": True}),
    json.dumps({**RECORD.to_json(), "env": {"MLXD_ENGINE_PORT": 14001}}),
    json.dumps({k: v for k, v in RECORD.to_json().items() if k != "gateway_port"}),
])
def test_an_unreadable_file_is_nothing_remembered(tmp_path, text):
    paths = StatePaths(tmp_path)
    paths.run.mkdir()
    paths.started_with.write_text(text)
    assert started_with.read(paths) is None


def test_written_atomically_read_back_and_forgotten_only_by_its_writer(tmp_path, monkeypatch):
    paths = StatePaths(tmp_path)
    for name in started_with.OVERRIDE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLXD_GATEWAY_PORT", "14000")
    config = parse_config({"gateway": {"port": 14000}}, tmp_path)
    written = started_with.remember(config, tmp_path / "mlxd.toml", paths)
    assert started_with.read(paths) == written and written.env == {"MLXD_GATEWAY_PORT": "14000"}
    assert [p.name for p in paths.run.iterdir()] == ["started_with.json"]  # no temp file left
    started_with.forget(paths, writer_pid=written.up_pid + 1)  # another `up`'s: kept
    assert started_with.read(paths) == written
    started_with.forget(paths)
    assert started_with.read(paths) is None
    started_with.forget(paths)  # nothing to forget is fine


def test_use_overrides_sets_exactly_those(monkeypatch):
    for name in started_with.OVERRIDE_VARS:  # set first, so monkeypatch records them and unsets them after
        monkeypatch.setenv(name, "unset after the test")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLXD_ENGINE_PORT", "1")
    monkeypatch.setenv("MLXD_OLLAMA_URL", "http://x:1")
    started_with.use_overrides({"MLXD_GATEWAY_PORT": "2", "MLXD_OLLAMA_URL": "http://y:2"})
    import os

    assert {k: os.environ.get(k) for k in started_with.OVERRIDE_VARS if k in os.environ} == \
           {"MLXD_GATEWAY_PORT": "2", "MLXD_OLLAMA_URL": "http://y:2"}


@pytest.mark.parametrize("record, shown", [
    (None, None),
    ({**RECORD.to_json(), "env": {}}, None),  # started from mlxd.toml alone: nothing to say
    (RECORD.to_json(), "MLXD_CONFIG=/etc/mlxd/custom.toml MLXD_ENGINE_PORT=14001 MLXD_GATEWAY_PORT=14000"
                       "  (from `mlxd up`)"),
])
def test_status_names_the_variables_up_was_given(record, shown):
    assert format_started_with(StartedWith.from_json(record)) == shown


def test_the_path_is_under_run():
    assert StatePaths(Path("/h")).started_with == Path("/h/run/started_with.json")


def test_only_an_engine_under_our_supervisord_counts_as_ready():
    import subprocess

    from mlxd.cli.readiness import runs_under

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert runs_under(child.pid, os.getpid())  # ours: a descendant
        assert not runs_under(os.getpid(), child.pid)  # another program's engine on our port
        assert runs_under(None, os.getpid()) and runs_under(child.pid, None)  # unknown: as before
    finally:
        child.kill()
        child.wait()
    assert not runs_under(child.pid, os.getpid())  # gone
