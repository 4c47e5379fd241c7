"""A client that hangs up during a long prefill frees the engine at once.

The engine holds an answer's headers until its first token, so during a
prefill a client that gives up has read nothing. Before, the request ran on
upstream of it: through LiteLLM (every route with the fast path off) and on
the fast path (Anthropic's /v1/messages too) before the first byte the
gateway kept its connection to the engine open, and the engine's prefill
never looked at the cancel. With `slow@prefill:40` a 700-token prompt takes ~28 s to prefill;
each case hangs up once the engine is prefilling and needs it idle within a
few seconds, then answering the next request.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
import requests

from mlxd.devkit.wait import wait_for

PROMPT = "tell me about the slow machine " * 100  # ~700 tokens: ~28 s of prefill at 40 ms a token
FAULT = "slow@prefill:40"
IDLE_WITHIN_S = 8.0  # one prefill step (sized well inside the stuck grace) and the hops, with room for a busy CPU


def engine_phase(st) -> tuple[str, list]:
    h = requests.get(st.url + "/health", timeout=5).json()
    return h["phase"], h["running"]


def hang_up_during_prefill(st, path: str, body: dict) -> float:
    """Sends the request over a raw socket, closes it once the engine is
    prefilling it; seconds until the engine is idle again."""
    u = urlsplit(st.gateway_url)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {st.key}\r\nx-api-key: {st.key}\r\nanthropic-version: 2023-06-01\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    try:
        sock.sendall(head + data)
        assert wait_for(lambda: engine_phase(st)[0] == "prefill", timeout=60), "the engine never prefilled it"
        sock.settimeout(0.2)
        try:
            assert sock.recv(1) == b"", "the answer started before the client hung up"
        except socket.timeout:
            pass  # nothing sent yet, as expected
    finally:
        sock.close()
    t0 = time.monotonic()
    assert wait_for(lambda: engine_phase(st)[0] == "idle", timeout=60, interval=0.1), "the engine stayed busy"
    return time.monotonic() - t0


CHAT = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": PROMPT}]}
MESSAGES = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": PROMPT}]}
CASES = [
    ("fast path, streamed", "", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("fast path, whole answer", "", "/v1/chat/completions", CHAT),
    ("fast path, Anthropic's messages streamed", "", "/v1/messages", {**MESSAGES, "stream": True}),
    ("LiteLLM, fast path off", "engine_fast_path = false\n", "/v1/chat/completions", {**CHAT, "stream": True}),
]


@pytest.mark.parametrize("name, gateway, path, body", CASES, ids=[c[0] for c in CASES])
def test_a_client_that_hangs_up_in_prefill_frees_the_engine(stack, name, gateway, path, body):
    st = stack(engine="stuck_grace_s = 5.0\n", gateway=gateway, fault=FAULT)  # a slow step is no hang
    idle_after = hang_up_during_prefill(st, path, body)
    assert idle_after < IDLE_WITHIN_S, f"{name}: the engine went on {idle_after:.1f} s after the client left"
    st.fault_file.write_text("")  # the next request at full speed: the engine answers it
    r = requests.post(st.gateway_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {st.key}"},
                      json={"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
                      timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None
    assert "Traceback" not in st.log_tail(200)


def test_a_client_that_hangs_up_mid_stream_stops_the_generation(stack):
    """After the first byte too (the fast path's stream): the gateway cancels the relay, which closes its
    connection to the engine, and the engine ends the generation within a token, long before max_tokens."""
    st = stack(gateway="")
    u = urlsplit(st.gateway_url)
    data = json.dumps({"model": "default", "max_tokens": 8000, "stream": True, "temperature": 0,
                       "messages": [{"role": "user", "content": "write a long story"}]}).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    try:
        sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
                      f"Content-Type: application/json\r\nAuthorization: Bearer {st.key}\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
        assert sock.recv(64).startswith(b"HTTP/1.1 200"), "the stream did not start"
        assert wait_for(lambda: engine_phase(st)[0] == "decode", timeout=60), "the engine never decoded it"
    finally:
        sock.close()
    assert wait_for(lambda: engine_phase(st)[0] == "idle", timeout=IDLE_WITHIN_S, interval=0.1), \
        "the engine went on generating after the client left"
    done = requests.get(st.url + "/metrics", timeout=5).text
    generated = [float(ln.split()[-1]) for ln in done.splitlines() if ln.startswith("mlxd_engine_generated_tokens")]
    assert generated and generated[0] < 8000  # cut short, not run to max_tokens
