"""Single concurrency, the bounded FIFO queue, deadlines and disconnects,
against real engine processes."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from testkit import chat, metric, wait_until

pytestmark = pytest.mark.timeout(180)


def hold_worker(url: str, max_tokens: int = 100_000) -> requests.Response:
    """Start a long streamed generation and return once its first token is
    here: the worker is busy until the response is closed."""
    r = requests.post(url + "/v1/completions", stream=True, timeout=60,
                      json={"model": "default", "prompt": "hold", "max_tokens": max_tokens, "stream": True,
                            "temperature": 0})  # greedy: the demo model then never picks EOS
    assert r.status_code == 200
    r.lines = r.iter_lines()  # kept with the response: a collected iterator closes the stream
    wait_until(lambda: next(r.lines).startswith(b"data: "), 30, interval=0, what="first streamed token")
    return r


def raw_request(eng, body: dict) -> socket.socket:
    """Send a request on a bare socket (so the test can vanish without reading), with the engine's key."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", eng.port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {eng.key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


def test_three_concurrent_requests_run_one_at_a_time_in_arrival_order(start_engine):
    # One token a forward: the demo model's looping answers would otherwise end before the next request queues.
    eng = start_engine({"max_queue": 4, "max_tokens_cap": 100_000, "speculative": "off"})
    finished: list[tuple[int, float]] = []
    results: dict[int, int] = {}

    def send(i: int) -> None:
        r = chat(eng.url, max_tokens=300)
        results[i] = r.status_code
        finished.append((i, time.monotonic()))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    threads[0].start()
    wait_until(lambda: eng.health()["in_flight"], 30, what="request 0 running")
    threads[1].start()
    wait_until(lambda: eng.health()["queue_depth"] == 1, 30, what="request 1 queued")
    threads[2].start()
    wait_until(lambda: eng.health()["queue_depth"] == 2, 30, what="request 2 queued")
    for t in threads:
        t.join(120)
    assert results == {0: 200, 1: 200, 2: 200}
    assert [i for i, _ in sorted(finished, key=lambda f: f[1])] == [0, 1, 2]
    assert metric(eng.url, "mlxd_engine_max_observed_concurrency") == 1


def test_full_queue_answers_429_with_retry_after(start_engine):
    eng = start_engine({"max_queue": 1, "max_tokens_cap": 100_000})
    holder = hold_worker(eng.url)
    queued = raw_request(eng, {"model": "default", "messages": [{"role": "user", "content": "q"}],
                                    "max_tokens": 2})
    try:
        wait_until(lambda: eng.health()["queue_depth"] == 1, 30, what="one request queued")
        r = chat(eng.url)
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["Retry-After"]) >= 1 and r.headers["x-mlxd-error-code"] == "queue_full"
    finally:
        holder.close()
        queued.close()
    wait_until(lambda: (h := eng.health())["in_flight"] is None and h["queue_depth"] == 0, 10, what="engine idle")
    assert chat(eng.url).status_code == 200  # and the engine still serves


def test_queue_wait_timeout_answers_503_with_retry_after(start_engine):
    eng = start_engine({"max_queue": 4, "queue_timeout_s": 0.5, "max_tokens_cap": 100_000})
    holder = hold_worker(eng.url)
    try:
        t0 = time.monotonic()
        r = chat(eng.url)
        waited = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
        assert int(r.headers["Retry-After"]) >= 1
        assert 0.5 <= waited < 5
        assert eng.health()["queue_depth"] == 0  # its place was freed
    finally:
        holder.close()


def test_disconnect_mid_stream_frees_the_worker(start_engine):
    eng = start_engine({"max_tokens_cap": 100_000})
    tokens_before = metric(eng.url, "mlxd_engine_generated_tokens")
    holder = hold_worker(eng.url, max_tokens=50_000)
    holder.close()
    wait_until(lambda: eng.health()["in_flight"] is None, 5, what="worker freed after disconnect")
    generated = metric(eng.url, "mlxd_engine_generated_tokens") - tokens_before
    assert 1 <= generated < 5_000  # stopped long before max_tokens
    t0 = time.monotonic()
    r = chat(eng.url, max_tokens=2)
    assert r.status_code == 200 and time.monotonic() - t0 < 5


def test_disconnect_before_the_first_chunk_frees_the_worker(start_engine):
    """A client gone while its first token is on the way: the handler returns
    the stream response, and Starlette drops it without starting it. The job
    must still stop (the cleanup lives with the response, not only in the
    stream generator's `finally`)."""
    eng = start_engine({"max_tokens_cap": 100_000, "request_deadline_s": 120})
    for attempt in range(5):  # each vanishes within a few ms, well before the handler's 0.25 s disconnect poll
        s = raw_request(eng, {"model": "default", "messages": [{"role": "user", "content": f"go {attempt}"}],
                                   "max_tokens": 100_000, "stream": True, "temperature": 0})
        s.close()
        wait_until(lambda: eng.health()["in_flight"] is None, 5, what=f"worker freed after disconnect {attempt}")
    t0 = time.monotonic()
    r = chat(eng.url, max_tokens=2)
    assert r.status_code == 200 and time.monotonic() - t0 < 5


def test_disconnect_while_queued_frees_the_place(start_engine):
    eng = start_engine({"max_queue": 2, "max_tokens_cap": 100_000})
    holder = hold_worker(eng.url)
    try:
        queued = raw_request(eng, {"model": "default", "messages": [{"role": "user", "content": "q"}]})
        wait_until(lambda: eng.health()["queue_depth"] == 1, 30, what="request queued")
        queued.close()
        wait_until(lambda: eng.health()["queue_depth"] == 0, 5, what="queued place freed after disconnect")
        assert eng.health()["in_flight"] is not None  # the running one is untouched
    finally:
        holder.close()


def test_request_deadline_ends_with_length_and_frees_the_worker(start_engine):
    eng = start_engine({"request_deadline_s": 0.5, "max_tokens_cap": 100_000})
    t0 = time.monotonic()
    r = chat(eng.url, max_tokens=100_000)
    elapsed = time.monotonic() - t0
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["finish_reason"] == "length"
    assert 0 < body["usage"]["completion_tokens"] < 100_000
    assert elapsed < 5
    # The answer is whole; the worker then stores the turn and lets go of it.
    wait_until(lambda: eng.health()["in_flight"] is None, 5, what="the worker to let go of the request")
