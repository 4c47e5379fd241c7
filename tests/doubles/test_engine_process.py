"""devkit/engine_process.py and the stack's config: how tests and benchmarks
start a server -- its environment, its config, readiness polled with a
deadline (a server that exits or never answers fails with its log), and a
stop by pid."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from mlxd.devkit.engine_process import NotReady, ServerProcess, mlxd_env, spawn, start_engine
from mlxd.devkit.ports import free_port
from mlxd.devkit.stack import stack_toml


def test_mlxd_env_is_offline_in_its_home_without_the_callers_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXD_CONFIG", "/elsewhere.toml")
    monkeypatch.setenv("MLXD_ENGINE_PORT", "1")
    monkeypatch.setenv("MLXD_CPU_BLAS", "reference")
    monkeypatch.setenv("KEPT", "yes")
    env = mlxd_env(tmp_path, {"MLXD_FAULT": "abort@boot", "MLXD_CPU_BLAS": None})
    assert env["MLXD_HOME"] == str(tmp_path) and env["HF_HUB_OFFLINE"] == "1" and env["KEPT"] == "yes"
    assert "MLXD_CONFIG" not in env and "MLXD_ENGINE_PORT" not in env
    assert env["MLXD_FAULT"] == "abort@boot"  # given: kept
    assert "MLXD_CPU_BLAS" not in env  # None: unset


def test_the_stack_config_takes_settings_as_values_or_as_text():
    model = Path('/models/a "quoted" \\ path')
    text = stack_toml(model, "llama3.1:8b", 1234, 5678,
                      engine={"stuck_grace_s": 1.0, "prompt_cache": {"disk": False}},
                      supervisor="backoff_base_s = 0.2\n", gateway='ollama_url = "http://127.0.0.1:1"',
                      models='ollama = "m"\n[models.far]\npath = "/far"\n')
    assert tomllib.loads(text) == {
        "engine": {"port": 1234, "stuck_grace_s": 1.0, "prompt_cache": {"disk": False}},
        "supervisor": {"backoff_base_s": 0.2},
        "gateway": {"port": 5678, "ollama_url": "http://127.0.0.1:1"},
        "models": {"llama3.1:8b": {"path": str(model), "ollama": "m"}, "far": {"path": "/far"}},
        "aliases": {"default": "llama3.1:8b"},
    }
    no_gateway = tomllib.loads(stack_toml(model, "m", 1, None, gateway={"port": 2}))
    assert no_gateway["gateway"] == {"enabled": False}


@pytest.mark.integration  # starts processes
def test_start_engine_writes_its_config_as_text_or_values(tmp_path):
    class Recorded(ServerProcess):
        pass

    ep = start_engine(tmp_path / "home", {"models": {"m": {"path": tmp_path / "it's"}}}, kind=Recorded,
                      launcher=[sys.executable, "-c", "import sys; sys.exit(0)"])  # runs no engine
    ep.proc.wait(30)
    assert isinstance(ep, Recorded) and (tmp_path / "home" / "engine.log").exists()
    config = tomllib.loads((tmp_path / "home" / "mlxd.toml").read_text())
    assert config == {"models": {"m": {"path": str(tmp_path / "it's")}}}
    start_engine(tmp_path / "home", None, launcher=[sys.executable, "-c", "pass"]).proc.wait(30)  # a restart
    assert "it's" in (tmp_path / "home" / "mlxd.toml").read_text()


def python(code: str, tmp_path: Path, port: int = 0, health_path: str = "/health") -> ServerProcess:
    return spawn("test server", [sys.executable, "-c", code], {}, tmp_path / "server.log", port or free_port(),
                 health_path)


@pytest.mark.integration  # starts processes
def test_a_server_that_exits_while_starting_fails_with_its_log(tmp_path):
    server = python("print('cannot bind'); raise SystemExit(3)", tmp_path)
    with pytest.raises(NotReady, match=r"(?s)exited with 3 while starting.*cannot bind"):
        server.wait_ready(30)


@pytest.mark.integration  # starts processes
def test_a_server_that_never_answers_fails_at_its_deadline_and_stops_by_pid(tmp_path):
    server = python("import time; print('loading', flush=True); time.sleep(600)", tmp_path)
    with pytest.raises(NotReady, match=r"(?s)not ready after 1s.*loading"):
        server.wait_ready(1)
    server.stop(grace=5)
    assert server.proc.returncode is not None


@pytest.mark.integration  # starts processes
def test_a_server_is_ready_once_its_health_path_answers_200(tmp_path):
    port = free_port()
    server = python(f"import http.server as h; h.test(h.SimpleHTTPRequestHandler, port={port}, bind='127.0.0.1')",
                    tmp_path, port, "/")
    try:
        server.wait_ready(30)
        assert server.proc.poll() is None
    finally:
        server.stop(grace=5)
    assert server.proc.returncode is not None
