"""The gateway's ASGI app: our key check in front of LiteLLM's proxy app.

LiteLLM without a database answers a missing key with 500 and a wrong one
with 400 (checked on 1.106.2); clients and tests need 401 in OpenAI's
format. So every request passes this guard first. LiteLLM itself gets a
random master key that lives only in this process's memory; the guard
swaps the client's (checked) key for it. The key file is re-read when it
changes, so a rotation needs no restart. Only the health routes
(gateway/health.py) and the status page's static files (gateway/status_page.py:
no data in them) are open; the page's data, /mlxd/status, needs the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxd.api_errors import (ANTHROPIC_PATHS, ERROR_CODE_HEADER, ERROR_PARAM_HEADER, anthropic_error_body,
                             error_type)
from mlxd.keyfile import OWNER_HEADER, KeyFile

from .errors import FALLBACK_FAILED, FALLBACK_HEADER, JSON, LITELLM_WRAPPER, ApiError, fallback_note, send_error, send_json
from .health import PATHS as HEALTH_PATHS
from .health import Health
from .keys import matches, owner_of_key
from .openapi import DOCUMENT_PATH
from .stored_responses import STORED_PATH
from .status_page import DATA_PATH as STATUS_DATA_PATH
from .status_page import StatusPage, asset_for

# The OpenAI API is all the gateway serves: LiteLLM's admin routes (keys,
# users, UI, spend...) are not reachable even with the key.
SERVED_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
                          "/v1/models", "/models",
                          # OpenAI's Responses API: the engine's own route (engine/api/responses_api.py).
                          "/v1/responses", "/responses",
                          # Anthropic's Messages API, for coding agents: the engine's own route
                          # (engine/api/messages_api.py), LiteLLM's adapter for the fallback and count_tokens.
                          "/v1/messages", "/v1/messages/count_tokens",
                          # Embeddings: the engine's encoder, Ollama's twin as the fallback.
                          "/v1/embeddings", "/embeddings",
                          # Rerank (Cohere's v1 and v2 paths, Jina's): the engine's rerankers, no fallback.
                          "/v1/rerank", "/rerank", "/v2/rerank"})
# Auth headers never reach LiteLLM (it gets its inner key); nor does
# accept-encoding: a gzip-compressed error could not be rewritten.
AUTH_HEADERS = (b"authorization", b"x-api-key", b"api-key", b"accept-encoding", OWNER_HEADER.encode())


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


def admit(scope_type: str, path: str, key: str | None, given: str | None) -> ApiError | None:
    """None: the request goes on (to LiteLLM, or to the status page's
    document); else why it is refused (pure). No key file (key None)
    refuses everything rather than serve openly."""
    if key is None or not matches(given, key):
        return ApiError(401, "missing API key: send 'Authorization: Bearer <key>' (see `mlxd key show`)"
                        if given is None else "invalid API key", "invalid_api_key")
    served = (path in SERVED_PATHS or path in (STATUS_DATA_PATH, DOCUMENT_PATH) or path.startswith("/v1/models/")
              or STORED_PATH.fullmatch(path) is not None)
    if scope_type != "http" or not served:
        return ApiError(404, f"no such route: {path[:100]}", "not_found")
    return None


# The code an error from LiteLLM gets where it has none, or a number for one.
CODE_BY_STATUS = {400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                  408: "timeout", 413: "request_too_large", 422: "invalid_request", 429: "rate_limited"}


def _word_code(code: object) -> bool:
    return isinstance(code, str) and bool(code) and not code.isdigit()


AFTER_THE_ERROR = "\n\nLiteLLM: model group"  # where LiteLLM's own words start, after the upstream's
PROVIDER = "llm_provider-"  # LiteLLM's prefix for an upstream's response headers


def unwrap_engine_error(status: int, body: bytes, headers: dict[str, str]) -> tuple[bytes, bytes | None]:
    """An engine's error as the engine wrote it, out of LiteLLM's (pure).
    Where LiteLLM relayed an engine's refusal, its message is LiteLLM's
    exception names, the engine's error (its whole JSON, or for some errors
    only its message, its code and param then in the engine's headers, which
    LiteLLM passes on as `llm_provider-x-mlxd-error-code`), then what its
    fallback did. The client gets the engine's error object and the
    fallback's outcome apart, for the `x-mlxd-fallback` header. Anything
    else: (body, None). `headers`: the answer's, lower-cased."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body, None
    wrapper = LITELLM_WRAPPER.match(message) if isinstance(message, str) else None
    if wrapper is None:
        return body, None
    code = headers.get(PROVIDER + ERROR_CODE_HEADER)
    try:
        inner, end = json.JSONDecoder().raw_decode(message, wrapper.end())
        err = inner.get("error") if isinstance(inner, dict) else None
    except ValueError:
        end = message.find(AFTER_THE_ERROR, wrapper.end())
        end = len(message) if end < 0 else end
        err = None if code is None else {"message": message[wrapper.end():end], "type": error_type(status),
                                         "param": headers.get(PROVIDER + ERROR_PARAM_HEADER), "code": code}
    if not isinstance(err, dict) or not _word_code(err.get("code")) or not isinstance(err.get("message"), str):
        return body, None
    failed = FALLBACK_FAILED.search(message, end)
    return json.dumps({"error": err}).encode(), fallback_note(failed.group(1), failed.group(2)) if failed else None


def kept_retry_after(headers: dict[str, str]) -> str | None:
    """The upstream's Retry-After LiteLLM kept only as `llm_provider-retry-after`,
    where the answer has none of its own (pure)."""
    return None if "retry-after" in headers else headers.get(PROVIDER + "retry-after")


def rewrite_backend_error(status: int, body: bytes) -> tuple[int, bytes]:
    """LiteLLM's error answers in OpenAI's shape (pure): its routing errors
    ({"detail": ...}) and starlette's plain text become error objects, a
    missing "type" is filled in, and "engine down and Ollama down too" (a
    500 with a long message) becomes a plain 503."""
    text = body.decode(errors="replace")
    if status in (404, 405) and '"detail"' in text and '"error"' not in text:  # LiteLLM's own routing errors
        try:
            detail = str(json.loads(text).get("detail"))
        except (ValueError, AttributeError):
            detail = text
        return status, ApiError(status, detail, "not_found" if status == 404 else "method_not_allowed").body()
    if not text.lstrip().startswith("{"):  # e.g. starlette's plain "Internal Server Error"
        return status, ApiError(status, f"gateway error: {text.strip()[:200] or 'no detail'}", "gateway_error",
                                "server_error").body()
    if status < 500:  # LiteLLM's 4xx sometimes say "type": null: fill it in, OpenAI-style
        try:
            doc = json.loads(text)
        except ValueError:
            return status, body
        err = doc.get("error") if isinstance(doc, dict) else None
        if isinstance(err, dict) and (not isinstance(err.get("type"), str) or not _word_code(err.get("code"))):
            err["type"] = err["type"] if isinstance(err.get("type"), str) else error_type(status)
            if not _word_code(err.get("code")):  # LiteLLM's "400": a client decides on a word
                err["code"] = CODE_BY_STATUS.get(status, "backend_error")
            return status, json.dumps(doc).encode()
        return status, body
    if status == 500 and "Fallback to" in text and "also failed" in text:
        unreachable = ("Cannot connect" in text or "Connection error" in text or "ConnectError" in text
                       or "Connection refused" in text)
        if unreachable:
            msg = ("no backend could answer: the MLX engine is unavailable (down, restarting or busy) and the "
                   "Ollama fallback did not answer either; retry shortly")
            return 503, ApiError(503, msg, "backends_unavailable").body()
    return status, body


def in_route_shape(path: str, status: int, body: bytes) -> bytes:
    """An error body in OpenAI's shape (LiteLLM's, after rewrite_backend_error)
    in Anthropic's on its Messages routes, the code kept inside (pure); any
    other, or one already in Anthropic's shape (the engine's), as it is."""
    if path not in ANTHROPIC_PATHS:
        return body
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict) or doc.get("type") == "error":
        return body
    code = err.get("code") if _word_code(err.get("code")) else CODE_BY_STATUS.get(status, "backend_error")
    return json.dumps(anthropic_error_body(status, str(err.get("message") or ""), code, err.get("param"))).encode()


class ErrorRewriter:
    """Wraps `send`: error responses (>= 400) are held back and passed
    through rewrite_backend_error (and in_route_shape for the request's
    `path`); everything else streams as is."""

    def __init__(self, send: Any, path: str = "") -> None:
        self.send = send
        self.path = path
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
        named = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.start.get("headers", [])}
        body, fallback = unwrap_engine_error(self.start["status"], b"".join(self.parts), named)
        status, body = rewrite_backend_error(self.start["status"], body)
        body = in_route_shape(self.path, status, body)
        headers = [(k, v) for k, v in self.start.get("headers", [])
                   if k.lower() not in (b"content-length", b"content-type")]
        if fallback is not None:
            headers.append((FALLBACK_HEADER, fallback))
        if (retry_after := kept_retry_after(named)) is not None:
            headers.append((b"retry-after", retry_after.encode("latin-1")))
        await send_json(self.send, status, body, [*headers, JSON])


class KeyGuard:
    def __init__(self, app: Any, key_path: Path, inner_key: str, health: Health, status_page: StatusPage) -> None:
        self.app = app
        self.key_path = key_path
        self.health = health
        self.status_page = status_page
        self._inner_auth = (b"authorization", b"Bearer " + inner_key.encode())
        self.key = KeyFile(key_path)  # read again when `mlxd key rotate` renews it

    def current_key(self) -> str | None:
        return self.key.current()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # the status page's sampler lives as long as the gateway
            await self.app(scope, self.status_page.lifespan_receive(receive), send)
            return
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] in HEALTH_PATHS:
            await self.health.answer(scope["path"], send)
            return
        asset = asset_for(scope["path"]) if scope["type"] == "http" else None
        if asset is not None:  # the status page's static files: open, no data in them
            await self.status_page.serve_asset(asset, scope["method"], send)
            return
        refusal = admit(scope["type"], scope["path"], self.current_key(), presented_key(scope.get("headers", [])))
        if refusal is not None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 4000 + refusal.status})
            else:
                await send_error(send, refusal, [(b"www-authenticate", b'Bearer realm="mlxd"')]
                                 if refusal.status == 401 else None, scope["path"])
            return
        if scope["path"] == STATUS_DATA_PATH:
            await self.status_page.serve_document(scope["method"], send)
            return
        # Who the caller is, for the engine's stored responses: set here only (a client's own is dropped above).
        owner = (OWNER_HEADER.encode(), owner_of_key(presented_key(scope.get("headers", [])) or "").encode())
        inner_headers = [h for h in scope.get("headers", []) if h[0].lower() not in AUTH_HEADERS]
        await self.app({**scope, "headers": inner_headers + [self._inner_auth, owner]}, receive,
                       ErrorRewriter(send, scope.get("path", "")))
