"""The engine's own key (engine.require_key, off by default): an engine
that other machines can reach answers nothing but /health without it, and
the gateway sends it on both its paths, with no key in LiteLLM's file."""

from __future__ import annotations

import os

import pytest
import requests

from testkit import chat

pytestmark = pytest.mark.timeout(300)


def test_an_engine_that_requires_its_key(start_engine, tmp_path_factory):
    ep = start_engine({"require_key": True})
    key_file = ep.home / "engine.key"
    key = key_file.read_text().strip()
    assert key.startswith("sk-mlxd-engine-") and os.stat(key_file).st_mode & 0o777 == 0o600
    for path in ("/v1/models", "/metrics"):
        r = requests.get(ep.url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert requests.get(ep.url + path, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert requests.post(ep.url + "/v1/chat/completions", timeout=10, json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}]}).status_code == 401
    assert requests.get(ep.url + "/health", timeout=10).status_code == 200  # the supervisor's probe
    r = requests.post(ep.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_no_key_by_default(start_engine):
    ep = start_engine()
    assert chat(ep.url).status_code == 200 and not (ep.home / "engine.key").exists()


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm-path"])
def test_the_gateway_sends_the_engine_its_key(stack, fast_path):
    st = stack(engine="require_key = true\n", gateway=f"engine_fast_path = {str(fast_path).lower()}")
    key = (st.home / "engine.key").read_text().strip()
    assert key not in st.paths.litellm_config.read_text()
    r = requests.post(st.gateway_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {st.key}"},
                      timeout=60, json={"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert "ollama" not in r.text  # the engine answered, not the fallback
    assert requests.get(st.url + "/v1/models", timeout=10).status_code == 401  # and nobody else gets in
