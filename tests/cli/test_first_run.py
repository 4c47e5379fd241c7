"""A newcomer's mistakes get one clear message with its fix, fast, and no
traceback: TOML errors, unknown settings, missing model folders, ports in
use, an engine that cannot load its model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxd.cli.preflight import model_problems, port_problems
from mlxd.config import parse_config
from mlxd.devkit.gguf_fixture import write_header_only
from mlxd.engine.model.demo_model import write_heavy_model_description
from mlxd.supervisor.control import kill_all, supervisord_pid
from mlxd.paths import StatePaths
from mlxd.toml_text import dumps
from testkit import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]  # starts processes
MLXD = [sys.executable, "-m", "mlxd.cli"]


def run_up(home: Path, toml: str | None, *extra: str, timeout: float = 150) -> subprocess.CompletedProcess:
    if toml is not None:
        (home / "mlxd.toml").write_text(toml)
    env = {**os.environ, "MLXD_HOME": str(home), "MLXD_ENGINE_PORT": str(free_port()),
           "MLXD_GATEWAY_PORT": str(free_port()), "HF_HUB_OFFLINE": "1"}
    for key in ("MLXD_CONFIG", "MLXD_FAULT", "MLXD_FAULT_FILE"):
        env.pop(key, None)
    try:
        return subprocess.run([*MLXD, "up", "--detach", *extra], env=env, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        kill_all(StatePaths(home))


@pytest.mark.parametrize("toml, code, says", [
    ("[engine\nport = 1\n", 78, ["is not valid TOML", "line 1", "Fix:"]),
    ("[engine]\nprot = 8080\n", 78, ["engine.prot: unknown setting; did you mean 'port'?", "Fix:"]),
    ("[enigne]\nport = 8080\n", 78, ["did you mean 'engine'?"]),
    ("[engine]\nmemory_fraction = 3\n", 78, ["engine.memory_fraction", "(got 3)"]),
    ('[models.m]\npath = "/nonexistent/model"\n', 78, ["models.m.path: /nonexistent/model does not exist", "Fix:"]),
    ('[models.m]\npath = "/"\n', 78, ["models.m.path: / has no config.json", "Fix:"]),
])
def test_a_bad_config_is_one_message_with_its_fix(tmp_path, toml, code, says):
    r = run_up(tmp_path, toml)
    assert r.returncode == code, r.stderr
    assert all(s in r.stderr for s in says), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) <= 4
    assert supervisord_pid(StatePaths(tmp_path)) is None  # nothing was started


def test_a_port_in_use_is_named_with_its_holder_and_the_setting(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**os.environ, "MLXD_HOME": str(tmp_path), "MLXD_ENGINE_PORT": str(free_port()),
               "MLXD_GATEWAY_PORT": str(port)}
        env.pop("MLXD_CONFIG", None)
        r = subprocess.run([*MLXD, "up", "--detach"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 71, r.stderr
    assert f"port {port} (the gateway's) is already in use by pid {os.getpid()}" in r.stderr
    assert "MLXD_GATEWAY_PORT" in r.stderr and "Traceback" not in r.stderr
    assert supervisord_pid(StatePaths(tmp_path)) is None


def test_an_engine_that_cannot_load_its_model_fails_fast_with_its_reason(tmp_path):
    import mlx.core as mx

    broken = tmp_path / "broken-model"  # config.json and weights, so the preflight passes; mlx-lm cannot load it
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    mx.save_safetensors(str(broken / "model.safetensors"), {"w": mx.zeros((1,))})
    started = time.monotonic()
    r = run_up(tmp_path, dumps({"models": {"m": {"path": broken}}}), "--timeout", "120")
    took = time.monotonic() - started
    assert r.returncode == 1, r.stderr
    assert "the engine cannot start" in r.stderr and "no-such-architecture not supported" in r.stderr, r.stderr
    assert "mlxd restart" in r.stderr and "Traceback" not in r.stderr
    assert took < 100, f"waited {took:.0f}s: should fail as soon as the journal says so, not at the timeout"


@pytest.mark.parametrize("layout, problem", [
    ("missing", "does not exist"),
    ("empty", "has no config.json"),
    ("config only", "no *.safetensors weights"),
    ("heavy config only", None),  # a 70B shape, over any budget here: never loaded, so no weights needed
    ("model", None),
])
def test_model_folder_checks(tmp_path, monkeypatch, layout, problem):
    monkeypatch.setenv("MLXD_MEMORY_TOTAL_BYTES", str(16 * 2**30))
    folder = tmp_path / "m"
    if layout == "heavy config only":
        write_heavy_model_description(folder, params_billion=70)
    elif layout != "missing":
        folder.mkdir()
    if layout in ("config only", "model"):
        (folder / "config.json").write_text("{}")
    if layout == "model":
        (folder / "model.safetensors").write_bytes(b"")
    config = parse_config({"models": {"m": {"path": str(folder)}, "r": {"repo": "org/name"}}}, tmp_path)
    found = model_problems(config)
    assert [problem in p.what for p in found] == ([True] if problem else [])


@pytest.mark.parametrize("make, problem", [
    (lambda d: d / "missing.gguf", "does not exist"),
    (lambda d: write_header_only(d / "k.gguf", "llama", {"blk.0.attn_q.weight": 14}), "tensor type Q6_K"),
    (lambda d: write_header_only(d / "g.gguf", "gemma2", {"blk.0.attn_q.weight": 1}), "architecture 'gemma2'"),
    (lambda d: write_header_only(d / "ok.gguf", "llama", {"blk.0.attn_q.weight": 3}), None),
])
def test_gguf_checks(tmp_path, make, problem):
    config = parse_config({"models": {"g": {"gguf": str(make(tmp_path))}}}, tmp_path)
    found = model_problems(config)
    assert [problem in p.what for p in found] == ([True] if problem else [])


def test_free_ports_pass_the_preflight(tmp_path):
    config = parse_config({"engine": {"port": free_port()}, "gateway": {"port": free_port()}}, tmp_path)
    assert port_problems(config) == []
