"""GET and DELETE /v1/responses/{id} at the gateway: the engine's stored
responses, the caller's own.

Only this Mac's engine stores Responses API answers (for
previous_response_id), and LiteLLM's own retrieval routes expect ids it
made itself, so these two routes go to the engine whatever the fast path's
setting, with the engine's key and the caller's hash (`x-mlxd-owner`, set by
KeyGuard). The engine answers another caller's id as an unknown one (404).
A response LiteLLM relayed (the fast path off, or the engine's refusal
replayed) carries LiteLLM's id, encrypted with its in-memory master key
around the engine's: LiteLLM's own helpers give the engine's id back.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any
from urllib.parse import quote

import aiohttp

from mlxd.keyfile import KeyFile, owner_headers

from .errors import JSON, ApiError, send_error, send_json

STORED_PATH = re.compile(r"/(?:v1/)?responses/([^/]+)")
ENGINE_ID = re.compile(r"resp_[0-9a-f]{1,100}")  # the engine's own (engine/api/responses_builder.py)
METHODS = ("GET", "DELETE")
TIMEOUT_S = 30.0
ENGINE_DOWN = ApiError(503, "the MLX engine, which stores responses, is unavailable (down or restarting): retry "
                            "shortly", "engine_unavailable")


def engine_response_id(response_id: str) -> str:
    """The engine's id behind one the client holds: itself, or the engine's
    inside LiteLLM's encrypted and encoded id (LiteLLM's helpers)."""
    if ENGINE_ID.fullmatch(response_id):
        return response_id
    from litellm.proxy.hooks.responses_id_security import decrypted_response_id
    from litellm.responses.utils import ResponsesAPIRequestUtils

    inner = decrypted_response_id(response_id)
    return str(ResponsesAPIRequestUtils.decode_responses_api_response_id(inner).get("response_id") or inner)


def as_asked(body: bytes, response_id: str) -> bytes:
    """The engine's answer with the id the client holds (LiteLLM's, where it relayed it) (pure)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    if isinstance(doc, dict) and doc.get("id") not in (None, response_id):
        doc["id"] = response_id
        return json.dumps(doc).encode()
    return body


def stored_response_id(path: str) -> str | None:
    """The id a request to a stored response names, or None when it names none (pure)."""
    match = STORED_PATH.fullmatch(path)
    return match.group(1) if match else None


class StoredResponses:
    """ASGI wrapper (inside KeyGuard): the two routes to the engine, anything else on to `app`."""

    def __init__(self, app: Any, engine_url: str, engine_key: KeyFile) -> None:
        self.app = app
        self.base = engine_url
        self.engine_key = engine_key
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        response_id = stored_response_id(scope.get("path", "")) if scope["type"] == "http" else None
        if response_id is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] not in METHODS:
            await send_error(send, ApiError(405, f"{scope['method'][:20]} is not allowed here: GET or DELETE",
                                            "method_not_allowed"), [(b"allow", b"GET, DELETE")], scope["path"])
            return
        if self.session is None or self.session.closed:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))
        url = f"{self.base}/v1/responses/{quote(engine_response_id(response_id), safe='')}"
        headers = {**self.engine_key.headers(), **owner_headers(scope.get("headers", ()))}
        try:
            async with self.session.request(scope["method"], url, headers=headers) as resp:
                body = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            await send_error(send, ENGINE_DOWN, [(b"retry-after", b"2")], scope["path"])
            return
        await send_json(send, status, as_asked(body, response_id) if status == 200 else body, [JSON])
