"""Fault injection, MLX errors, stuck workers, load failures and SIGTERM,
against real engine processes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from mlxd import exit_codes
from mlxd.toml_text import dumps
from testkit import chat, wait_until

pytestmark = pytest.mark.timeout(180)


def stream_lines(url: str, max_tokens: int, timeout: float = 30) -> list[bytes]:
    """A streamed chat; every non-empty SSE line until the server ends it."""
    lines: list[bytes] = []
    try:
        with requests.post(url + "/v1/chat/completions", stream=True, timeout=timeout,
                           json={"model": "default", "messages": [{"role": "user", "content": "x"}],
                                 "max_tokens": max_tokens, "stream": True, "temperature": 0}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except requests.exceptions.RequestException:
        pass  # the process died under us: what arrived is in `lines`
    return lines


def test_abort_fault_kills_the_engine_by_sigabrt_at_the_chosen_token(start_engine):
    eng = start_engine(env={"MLXD_FAULT": "abort@token:3"})
    lines = stream_lines(eng.url, max_tokens=50)
    assert eng.proc.wait(30) == -signal.SIGABRT
    deltas = [ln for ln in lines if b'"content"' in ln and b'"role"' not in ln]
    assert len(deltas) <= 3  # died at token 3
    assert b"data: [DONE]" not in lines  # the client never sees a fake success


def test_abort_at_boot_dies_before_serving(start_engine):
    eng = start_engine(env={"MLXD_FAULT": "abort@boot"}, wait_ok=False)
    assert eng.proc.wait(60) == -signal.SIGABRT


def test_mlx_error_answers_500_and_exits_with_the_mlx_error_code(start_engine):
    eng = start_engine(env={"MLXD_FAULT": "raise@token:2"})
    r = chat(eng.url, max_tokens=20)
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "mlx_error" and "METAL" in err["message"]
    assert eng.proc.wait(30) == exit_codes.MLX_ERROR
    assert "fatal MLX error" in eng.log()


def test_mlx_error_mid_stream_is_an_explicit_error_event_without_done(start_engine):
    eng = start_engine(env={"MLXD_FAULT": "raise@token:3"})
    lines = stream_lines(eng.url, max_tokens=20)
    assert lines and b'"mlx_error"' in lines[-1]
    assert b"data: [DONE]" not in lines
    assert eng.proc.wait(30) == exit_codes.MLX_ERROR


def test_mlx_error_while_loading_is_fatal_too(start_engine):
    eng = start_engine(env={"MLXD_FAULT": "raise@load"}, wait_ok=False)
    assert eng.proc.wait(60) == exit_codes.MLX_ERROR


def test_hung_worker_makes_health_unhealthy_and_the_request_fails_fast(start_engine):
    eng = start_engine({"stuck_grace_s": 1.0}, env={"MLXD_FAULT": "hang@token:2"})
    t0 = time.monotonic()
    r = chat(eng.url, max_tokens=20)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stuck"
    assert time.monotonic() - t0 < 10
    h = requests.get(eng.url + "/health", timeout=5)
    assert h.status_code == 503 and h.json()["status"] == "unhealthy"
    assert eng.proc.poll() is None  # alive but not serving: the supervisor's job to kill it


def test_missing_model_folder_is_503_and_the_engine_stays_up(start_engine, demo_models, tmp_path):
    eng = start_engine(toml=dumps({"models": {"demo-a": {"path": demo_models.a},
                                              "gone": {"path": tmp_path / "nowhere"}},
                                   "aliases": {"default": "demo-a"}}))
    r = chat(eng.url, model="gone")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    assert chat(eng.url).status_code == 200


def test_sigterm_drains_finishes_the_running_request_and_exits_0(start_engine):
    eng = start_engine({"max_tokens_cap": 100_000, "shutdown_grace_s": 30})
    results: dict[str, object] = {}

    def running() -> None:
        results["running"] = stream_lines(eng.url, max_tokens=400, timeout=60)

    t = threading.Thread(target=running)
    t.start()
    wait_until(lambda: eng.health()["in_flight"], 30, what="a request running")
    queued = {}
    tq = threading.Thread(target=lambda: queued.setdefault("r", chat(eng.url, max_tokens=2)))
    tq.start()
    wait_until(lambda: eng.health()["queue_depth"] == 1, 30, what="a request queued")
    os.kill(eng.proc.pid, signal.SIGTERM)
    tq.join(30)
    assert queued["r"].status_code == 503 and queued["r"].json()["error"]["code"] == "engine_unavailable"
    t.join(60)
    assert results["running"][-1] == b"data: [DONE]"  # finished, not cut
    assert eng.proc.wait(30) == 0


def test_sigterm_cancels_a_long_request_after_the_grace_period(start_engine):
    eng = start_engine({"max_tokens_cap": 100_000, "shutdown_grace_s": 0.5})
    results: dict[str, object] = {}
    t = threading.Thread(target=lambda: results.setdefault("lines", stream_lines(eng.url, 100_000, timeout=60)))
    t.start()
    wait_until(lambda: eng.health()["in_flight"], 30, what="a request running")
    t0 = time.monotonic()
    os.kill(eng.proc.pid, signal.SIGTERM)
    assert eng.proc.wait(30) == 0
    assert time.monotonic() - t0 < 10
    t.join(30)
    assert b"data: [DONE]" not in results["lines"]
    assert b'"engine_unavailable"' in results["lines"][-1]  # told, not silently cut


@pytest.mark.parametrize("ceiling", [16, 4096])
def test_a_slow_prefill_is_not_mistaken_for_a_hung_worker(start_engine, ceiling):
    # 20 ms a prompt token and a 2 s grace: one fixed step of 512 tokens would
    # last ~10 s and the engine would declare itself stuck (it did, before the
    # pace). Steps sized to the speed stay well inside the grace, each one a
    # heartbeat, whatever the configured ceiling (prefill_step_size).
    eng = start_engine({"stuck_grace_s": 2.0, "prefill_step_size": ceiling}, env={"MLXD_FAULT": "slow@prefill:20"})
    t0 = time.monotonic()
    r = requests.post(eng.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "tell me about the slow machine " * 40}]})
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 200 and elapsed > prompt_tokens * 0.02 * 0.9  # the prefill really was slow: 3x the grace
    h = requests.get(eng.url + "/health", timeout=5)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert "engine_stuck" not in eng.log() and "made no progress" not in eng.log()
