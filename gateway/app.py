"""The gateway's ASGI app: our key check in front of LiteLLM's proxy app.

LiteLLM without a database answers a missing key with 500 and a wrong one
with 400 (checked on 1.106.2); clients and tests need 401 in OpenAI's
format. So every request passes this guard first. LiteLLM itself gets a
random master key that lives only in this process's memory; the guard
swaps the client's (checked) key for it. The key file is re-read when it
changes, so a rotation needs no restart. Only /mlxd/health (liveness for
status and readiness polling) is open.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .keys import matches, read_key

OPEN_PATHS = frozenset({"/mlxd/health"})
# The OpenAI API is all the gateway serves: LiteLLM's admin routes (keys,
# users, UI, spend...) are not reachable even with the key.
SERVED_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
                          "/v1/models", "/models"})
# Auth headers never reach LiteLLM (it gets its inner key); nor does
# accept-encoding: a gzip-compressed error could not be rewritten.
AUTH_HEADERS = (b"authorization", b"x-api-key", b"api-key", b"accept-encoding")


def _unauthorized(message: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": {"message": message, "type": "authentication_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()
    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="mlxd"'),
               (b"content-length", str(len(body)).encode())]
    return 401, headers, body


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key from `Authorization: Bearer`, or `x-api-key` / `api-key`."""
    for name, value in headers:
        n = name.lower()
        if n == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif n in (b"x-api-key", b"api-key"):
            return value.decode("latin-1").strip() or None
    return None


def rewrite_backend_error(status: int, body: bytes) -> tuple[int, bytes]:
    """LiteLLM answers "engine down and Ollama down too" with a 500 and a
    long message; a client needs a 503 that says so plainly (pure)."""
    text = body.decode(errors="replace")
    if status in (404, 405) and '"detail"' in text and '"error"' not in text:  # LiteLLM's own routing errors
        try:
            detail = str(json.loads(text).get("detail"))
        except (ValueError, AttributeError):
            detail = text
        return status, json.dumps({"error": {"message": detail, "type": "invalid_request_error", "param": None,
                                             "code": "not_found" if status == 404 else "method_not_allowed"}}).encode()
    if not text.lstrip().startswith("{"):  # e.g. starlette's plain "Internal Server Error"
        return status, json.dumps({"error": {"message": f"gateway error: {text.strip()[:200] or 'no detail'}",
                                             "type": "server_error", "param": None, "code": "gateway_error"}}).encode()
    if status < 500:  # LiteLLM's 4xx sometimes say "type": null: fill it in, OpenAI-style
        try:
            doc = json.loads(text)
        except ValueError:
            return status, body
        err = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(err, dict) and not isinstance(err.get("type"), str):
            err["type"] = "authentication_error" if status == 401 else (
                "rate_limit_error" if status == 429 else "invalid_request_error")
            return status, json.dumps(doc).encode()
        return status, body
    if status == 500 and "Fallback to" in text and "also failed" in text:
        unreachable = ("Cannot connect" in text or "Connection error" in text or "ConnectError" in text
                       or "Connection refused" in text)
        if unreachable:
            msg = ("no backend could answer: the MLX engine is unavailable (down, restarting or busy) and the "
                   "Ollama fallback did not answer either; retry shortly")
            return 503, json.dumps({"error": {"message": msg, "type": "service_unavailable_error", "param": None,
                                              "code": "backends_unavailable"}}).encode()
    return status, body


class ErrorRewriter:
    """Wraps `send`: error responses (>= 500, small bodies) are held back and
    passed through rewrite_backend_error; everything else streams as is."""

    def __init__(self, send: Any) -> None:
        self.send = send
        self.start: dict | None = None
        self.parts: list[bytes] = []

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            self.start = message
            return
        if self.start is None or message["type"] != "http.response.body":
            await self.send(message)
            return
        self.parts.append(message.get("body", b""))
        if message.get("more_body"):
            return
        status, body = rewrite_backend_error(self.start["status"], b"".join(self.parts))
        headers = [(k, v) for k, v in self.start.get("headers", [])
                   if k.lower() not in (b"content-length", b"content-type")]
        headers.append((b"content-type", b"application/json"))
        await self.send({"type": "http.response.start", "status": status,
                         "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body})


class KeyGuard:
    def __init__(self, app: Any, key_path: Path, inner_key: str) -> None:
        self.app = app
        self.key_path = key_path
        self._inner_auth = (b"authorization", b"Bearer " + inner_key.encode())
        self._key: str | None = None
        self._mtime: float | None = None
        self.started = time.time()

    def current_key(self) -> str | None:
        try:
            mtime = os.stat(self.key_path).st_mtime
        except OSError:
            return None  # no key file: refuse everything rather than serve openly
        if mtime != self._mtime:
            self._key, self._mtime = read_key(self.key_path), mtime
        return self._key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if scope["path"] in OPEN_PATHS:
            await self._send(send, 200, [(b"content-type", b"application/json")],
                             json.dumps({"status": "ok", "pid": os.getpid(),
                                         "uptime_s": round(time.time() - self.started, 3)}).encode())
            return
        key = self.current_key()
        given = presented_key(scope.get("headers", []))
        if key is None or not matches(given, key):
            status, headers, body = _unauthorized(
                "missing API key: send 'Authorization: Bearer <key>' (see `mlxd key show`)" if given is None
                else "invalid API key")
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 4401})
                return
            await self._send(send, status, headers, body)
            return
        if scope["type"] != "http" or not (scope["path"] in SERVED_PATHS or scope["path"].startswith("/v1/models/")):
            body = json.dumps({"error": {"message": f"no such route: {scope['path'][:100]}", "type": "invalid_request_error",
                                         "param": None, "code": "not_found"}}).encode()
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 4404})
                return
            await self._send(send, 404, [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(body)).encode())], body)
            return
        inner_headers = [h for h in scope.get("headers", []) if h[0].lower() not in AUTH_HEADERS]
        await self.app({**scope, "headers": inner_headers + [self._inner_auth]}, receive, ErrorRewriter(send))

    @staticmethod
    async def _send(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
