"""The gateway's own OpenAPI document, GET /openapi.json (with the key).

The gateway serves the engine's API (the same request models decide what is
valid on both: gateway/routing.py), so its document is the engine's, cut
to the routes the gateway serves, with the gateway's key as its security
scheme. The engine's is read once, with the engine's key, when first asked
for; LiteLLM's own document (its admin routes, unreachable here) is never
served. What clients and fuzzers (schemathesis: tests/fuzz/) read.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import aiohttp

from mlxd.keyfile import KeyFile

from .errors import JSON, ApiError, send_error, send_json

DOCUMENT_PATH = "/openapi.json"
# The engine's operations the gateway serves (its SERVED_PATHS, in the engine's spelling).
SERVED = {"/v1/chat/completions": ("post",), "/v1/completions": ("post",), "/v1/responses": ("post",),
          "/v1/messages": ("post",), "/v1/embeddings": ("post",), "/v1/rerank": ("post",), "/v1/models": ("get",),
          "/v1/responses/{response_id}": ("get", "delete")}
ENGINE_DOWN = ApiError(503, "the gateway's API document is the engine's, and the engine is unavailable (down or "
                            "restarting): retry shortly", "engine_unavailable")


def gateway_document(engine_doc: dict[str, Any]) -> dict[str, Any]:
    """The engine's document cut to what the gateway serves (pure)."""
    doc = copy.deepcopy(engine_doc)
    doc["info"] = {**doc.get("info", {}), "title": "mlxd gateway",
                   "description": "The OpenAI (and Anthropic Messages) API of mlxd's gateway: the MLX engine's "
                                  "routes, with the Ollama fallback behind them. Every route needs the gateway key."}
    doc["paths"] = {path: {m: op for m, op in ops.items() if m in SERVED[path]}
                    for path, ops in doc.get("paths", {}).items() if path in SERVED}
    doc.setdefault("components", {})["securitySchemes"] = {"gatewayKey": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"gatewayKey": []}]
    return doc


class GatewayDocument:
    """ASGI wrapper (inside KeyGuard): GET /openapi.json answered here, the rest on to `app`."""

    def __init__(self, app: Any, engine_url: str, engine_key: KeyFile) -> None:
        self.app = app
        self.url = engine_url + DOCUMENT_PATH
        self.engine_key = engine_key
        self.body: bytes | None = None  # read once

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != DOCUMENT_PATH:
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            await send_error(send, ApiError(405, "GET only", "method_not_allowed"), [(b"allow", b"GET")])
            return
        if self.body is None:
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                    async with session.get(self.url, headers=self.engine_key.headers()) as resp:
                        if resp.status != 200:
                            raise aiohttp.ClientError(f"the engine answered {resp.status}")
                        self.body = json.dumps(gateway_document(await resp.json())).encode()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                await send_error(send, ENGINE_DOWN, [(b"retry-after", b"2")], DOCUMENT_PATH)
                return
        await send_json(send, 200, self.body if scope["method"] == "GET" else b"", [JSON])
