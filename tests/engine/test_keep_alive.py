"""Idle unload (engine/core/keep_alive.py) in a running engine: after
keep_alive with no request the model, its KV and MLX's buffer cache are given
back while /health is polled (probes are not activity), the next request
loads it again and its conversation comes back from the prompt cache's disk
tier; a request's own keep_alive (0, negative) as Ollama's API has it."""

from __future__ import annotations

import time

import pytest
import requests

from testkit import wait_until

pytestmark = pytest.mark.timeout(180)

SYSTEM = "You are a careful assistant for a small software team. " * 40  # a prompt worth keeping warm


def health(url: str) -> dict:
    return requests.get(url + "/health", timeout=10).json()


def ask(url: str, messages: list[dict], **extra) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "temperature": 0, "max_tokens": 8, "messages": messages, **extra})


def test_an_idle_model_is_given_back_and_its_conversation_comes_back_warm(start_engine):
    ep = start_engine({"keep_alive": "2s"})
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a prime number."}]
    r = ask(ep.url, first)
    assert r.status_code == 200, r.text
    loaded = health(ep.url)
    assert loaded["resident_model"] == "demo-a" and 0 < loaded["unload_in_s"] <= 2 and loaded["keep_alive_s"] == 2
    held = loaded["memory"]["mlx_active_bytes"] - loaded["memory"]["mlx_active_before_first_load"]
    assert held > 0
    # Polled all along: /health is not a request, and the model goes anyway.
    unloaded = wait_until(lambda: (h := health(ep.url))["resident_model"] is None and h, 15, 0.1, "the idle unload")
    assert unloaded["unloaded_idle_at"] is not None and unloaded["counters"]["idle_unloads"] == 1
    assert unloaded["unloaded_idle_model"] == "demo-a"
    metrics = requests.get(ep.url + "/metrics", timeout=10).text
    assert "mlxd_engine_idle_unloads 1.0" in metrics and "mlxd_engine_unload_in_seconds -1.0" in metrics
    left = unloaded["memory"]["mlx_active_bytes"] - unloaded["memory"]["mlx_active_before_first_load"]
    assert left <= 0.05 * held, (left, held)  # >= 95 % of what the model held is back
    assert unloaded["memory"]["mlx_cache_bytes"] <= 0.05 * held  # and MLX's buffer cache with it
    # The conversation goes on: the model is loaded again, its prompt mostly from the disk tier.
    answer = r.json()["choices"][0]["message"]["content"]
    r = ask(ep.url, first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Another."}])
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"], usage
    again = health(ep.url)
    assert again["resident_model"] == "demo-a" and again["unloaded_idle_at"] is None
    assert again["counters"]["model_loads"] == loaded["counters"]["model_loads"] + 1


def test_a_requests_keep_alive_sets_the_models_after_it(start_engine):
    ep = start_engine({"keep_alive": "1s"})
    hello = [{"role": "user", "content": "hello"}]
    assert ask(ep.url, hello, keep_alive=-1).status_code == 200  # never, after this one
    assert health(ep.url)["unload_in_s"] is None
    began = time.monotonic()
    while time.monotonic() - began < 3:  # well past the engine's 1 s: still resident
        assert health(ep.url)["resident_model"] == "demo-a"
        time.sleep(0.2)  # sampling the state over a window, not synchronising on it
    assert ask(ep.url, hello, keep_alive=0).status_code == 200  # unload once answered
    wait_until(lambda: health(ep.url)["resident_model"] is None, 10, 0.05, "the unload after keep_alive 0")
    assert ask(ep.url, hello, keep_alive="10m").status_code == 200
    assert 590 < health(ep.url)["unload_in_s"] <= 600
    r = ask(ep.url, hello, keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive", r.text
    assert "not a duration" in r.json()["error"]["message"]
