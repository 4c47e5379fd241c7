"""When the engine is down and Ollama is absent too, the client gets a
clear 503 quickly and /health/readiness says 503; and busy_spill makes a
busy engine refuse at once."""

import time

import pytest
import requests

from mlxd.supervisor.control import rpc
from testkit import free_port, wait_until

pytestmark = pytest.mark.timeout(300)


def test_no_engine_and_no_ollama_is_a_clear_503(stack):
    closed = free_port()  # nothing listens there: Ollama is "not installed"
    st = stack(gateway=f'ollama_url = "http://127.0.0.1:{closed}"\nbusy_spill = true')
    rpc(st.paths).supervisor.stopProcess("engine", True)
    wait_until(lambda: not st.healthy(), 10, what="engine down")
    body = {"model": "default", "messages": [{"role": "user", "content": "anyone?"}], "max_tokens": 4}
    for stream in (False, True):
        t0 = time.monotonic()
        r = requests.post(st.gateway_url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30,
                          headers={"Authorization": f"Bearer {st.key}"})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "backends_unavailable" and "Ollama" in err["message"]
        # No retry loop, no waiting out a timeout (30 s here): refused connections answer at once
        # (well under a second when the machine is not loaded; bounded loosely for a busy CI box).
        assert time.monotonic() - t0 < 8
    # Anthropic's route: LiteLLM's adapter answers it then; its error has Anthropic's shape, the code kept
    r = requests.post(st.gateway_url + "/v1/messages", json=body, timeout=30, headers={"x-api-key": st.key})
    assert r.status_code == 503 and r.json()["type"] == "error", r.text
    assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("overloaded_error", "backends_unavailable")
    assert st.status()["overall"] == "down"  # stopped by an operator, no fallback answers
    ready = st.gateway_url + "/health/readiness"  # LiteLLM's probe: open, and false with no backend
    assert requests.get(ready, timeout=10).json() == {"status": "unhealthy", "db": "Not connected"}
    assert requests.get(ready, timeout=10).status_code == 503
    rpc(st.paths).supervisor.startProcess("engine", False)
    wait_until(st.healthy, 60, what="engine back")
    assert requests.get(ready, timeout=10).status_code == 200
    # busy_spill: the engine keeps no queue, so a second request is refused at once (429 -> fallback)
    holder = requests.post(st.url + "/v1/completions", stream=True, timeout=60,
                           json={"model": "default", "prompt": "hold", "max_tokens": 100000, "stream": True,
                                 "temperature": 0})
    try:
        holder.lines = holder.iter_lines()
        next(holder.lines)
        r = requests.post(st.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    finally:
        holder.close()
