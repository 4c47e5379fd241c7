"""The engine's port requires its key (issue 52, item 1): every route but
the liveness probe answers 401 to a process that does not hold the key, on
loopback too; the key is made at the first start (0600), renewed by `mlxd
key rotate engine` without restarting the engine, and sent by the gateway on
both its paths, with no key in LiteLLM's file. Every port checks the Host
header against the names it serves (DNS rebinding)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

from mlxd.devkit.engine_process import MLXD, mlxd_env
from testkit import chat, wait_until

pytestmark = pytest.mark.timeout(300)

# Run in a process of its own that holds no key: no MLXD_HOME, only the URL and the routes.
NO_KEY_PROBE = r"""
import json, sys, requests
base, routes = sys.argv[1], json.loads(sys.argv[2])
out = []
for method, path in routes:
    for headers in ({}, {"Authorization": "Bearer sk-mlxd-engine-wrong"}, {"Authorization": "Basic bWx4ZDp3cm9uZw=="}):
        r = requests.request(method, base + path, headers=headers, json={}, timeout=30)
        out.append([method, path, r.status_code, r.text[:300]])
print(json.dumps(out))
"""


def engine_routes(ep) -> list[tuple[str, str]]:
    """Every route the engine's app serves: its OpenAPI document's (read with
    the key) and FastAPI's own pages, path parameters filled in."""
    doc = requests.get(ep.url + "/openapi.json", timeout=10).json()
    routes = [(method.upper(), path.replace("{response_id}", "resp_x"))
              for path, ops in doc["paths"].items() for method in ops]
    return routes + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/docs/oauth2-redirect"),
                     ("GET", "/no/such/route"), ("POST", "/livez")]


def test_no_route_of_the_engine_answers_a_process_without_its_key(start_engine):
    ep = start_engine()
    routes = engine_routes(ep)
    assert {("POST", "/v1/chat/completions"), ("GET", "/health"), ("GET", "/metrics"),
            ("DELETE", "/v1/responses/resp_x"), ("GET", "/livez")} <= set(routes)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    probe = subprocess.run([sys.executable, "-c", NO_KEY_PROBE, ep.bare_url, json.dumps(routes)], env=env,
                           capture_output=True, text=True, timeout=240, check=True)
    answers = json.loads(probe.stdout)
    assert len(answers) == 3 * len(routes)
    for method, path, status, text in answers:
        if (method, path) == ("GET", "/livez"):
            assert status == 200 and json.loads(text) == {"status": "alive"}  # nothing but "alive"
        else:
            assert status == 401, (method, path, status, text)
            assert json.loads(text)["error"]["code"] == "invalid_api_key", (method, path)
    # With the key, as the Bearer or as a URL's password (Basic), it serves.
    key = (ep.home / "engine.key").read_text().strip()
    assert requests.get(ep.bare_url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                        timeout=10).status_code == 200
    assert chat(ep.url, max_tokens=3).json()["usage"]["completion_tokens"] == 3


def test_the_key_is_made_private_and_never_logged(start_engine):
    ep = start_engine()
    key_file = ep.home / "engine.key"
    key = key_file.read_text().strip()
    assert key.startswith("sk-mlxd-engine-") and os.stat(key_file).st_mode & 0o777 == 0o600
    assert chat(ep.url).status_code == 200
    assert requests.get(ep.bare_url + "/v1/models", timeout=10).status_code == 401  # a refusal is logged, if at all,
    assert key not in ep.log()                                                       # without the key


def test_a_rotated_key_takes_effect_without_a_restart(start_engine):
    ep = start_engine()
    old = (ep.home / "engine.key").read_text().strip()
    pid = requests.get(ep.url + "/health", timeout=10).json()["pid"]
    done = subprocess.run([*MLXD, "key", "rotate", "engine"], env=mlxd_env(ep.home), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    new = (ep.home / "engine.key").read_text().strip()
    assert new != old and new.startswith("sk-mlxd-engine-") and new not in done.stdout + done.stderr
    assert os.stat(ep.home / "engine.key").st_mode & 0o777 == 0o600

    def status_with(key: str) -> int:
        return requests.get(ep.bare_url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                            timeout=10).status_code

    assert status_with(old) == 401 and status_with(new) == 200
    assert requests.get(ep.bare_url + "/health", headers={"Authorization": f"Bearer {new}"},
                        timeout=10).json()["pid"] == pid  # the same engine: no restart
    shown = subprocess.run([*MLXD, "key", "show", "engine"], env=mlxd_env(ep.home), capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 64 and new not in shown.stdout + shown.stderr  # internal: its path only


@pytest.mark.parametrize("host, allowed", [
    ("evil.example", False), ("evil.example:8080", False), ("127.0.0.1.nip.io", False), ("localhost.evil.example", False),
    ("localhost", True), ("LOCALHOST.:1", True), ("127.0.0.1", True), ("[::1]:9", True), ("host.docker.internal", True),
    ("10.1.2.3", True),
])
def test_a_rebound_name_is_refused_even_with_the_key(shared_engine, host, allowed):
    r = requests.get(shared_engine.url + "/v1/models", headers={"Host": host}, timeout=10)
    if allowed:
        assert r.status_code == 200
    else:
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", r.text
        assert "allowed_hosts" in r.json()["error"]["message"]


def test_a_configured_name_is_served(start_engine):
    ep = start_engine({"allowed_hosts": ["studio.lan"]})
    assert requests.get(ep.url + "/v1/models", headers={"Host": "studio.lan:8080"}, timeout=10).status_code == 200
    assert requests.get(ep.url + "/v1/models", headers={"Host": "laptop.lan"}, timeout=10).status_code == 400


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm-path"])
def test_the_gateway_sends_the_engine_its_key_and_takes_a_renewed_one(stack, fast_path):
    st = stack(gateway=f"engine_fast_path = {str(fast_path).lower()}")
    key = (st.home / "engine.key").read_text().strip()
    assert key not in st.paths.litellm_config.read_text()

    def ask() -> requests.Response:
        return requests.post(st.gateway_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {st.key}"},
                             timeout=60, json={"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 3})

    r = ask()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert "ollama" not in r.text  # the engine answered, not the fallback
    assert requests.get(st.bare_url + "/v1/models", timeout=10).status_code == 401  # and nobody else gets in
    assert requests.get(st.gateway_url + "/v1/models", headers={"Authorization": f"Bearer {st.key}",
                                                                "Host": "evil.example"}, timeout=10).status_code == 400
    engine_pid = st.engine_pid()
    rotated = st.mlxd("key", "rotate", "engine")
    assert rotated.returncode == 0 and "gateway restarted" in rotated.stdout, rotated.stdout + rotated.stderr
    assert (st.home / "engine.key").read_text().strip() != key
    wait_until(lambda: st.ready(), 60, what="the gateway back with the new key")
    r = ask()
    assert r.status_code == 200 and "ollama" not in r.text, r.text
    assert st.engine_pid() == engine_pid and st.records() == []  # the engine neither restarted nor was killed
