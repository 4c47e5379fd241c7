"""The listener's /health probe against an engine that misbehaves at the
socket level (it can die mid-answer): every case is a failed probe, never an
exception -- one once killed the supervision thread, and with it every
restart after (found by bench/recovery.py)."""

from __future__ import annotations

import socket
import threading

import pytest

from mlxd.reports import EngineHealth
from mlxd.supervisor.listener import health_event
from testkit import free_port

OK_BODY = b'{"status": "ok", "pid": 1}'
RESPONSES = {
    "ok": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(OK_BODY) + OK_BODY,
    "truncated body": b"HTTP/1.1 200 OK\r\nContent-Length: 665\r\n\r\n{\"status\": ",
    "truncated 503 body": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 665\r\n\r\n{\"sta",
    "503 with a non-object body": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n[]",
    "garbage json": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{{{{{",
    "not http": b"\x00\x01 hello\r\n\r\n",
    "closed at once": b"",
    "bad status line": b"HTTP/1.1 abc\r\n\r\n",
}


def serve_once(payload: bytes) -> int:
    """A one-shot server on a free port: reads the request, writes `payload`, closes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn, srv:
            conn.recv(65536)
            conn.sendall(payload)

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]


@pytest.mark.parametrize("case", sorted(RESPONSES))
def test_a_misbehaving_engine_is_a_failed_probe_never_an_exception(case):
    port = serve_once(RESPONSES[case])
    event, body = health_event(f"http://127.0.0.1:{port}/health", 123.0)
    assert event.ok is (case == "ok")
    if case == "ok":
        assert body == EngineHealth(status="ok", pid=1)
    assert event.t == 123.0


def test_nothing_listening_is_a_failed_probe():
    event, body = health_event(f"http://127.0.0.1:{free_port()}/health", 1.0)
    assert not event.ok and body is None
