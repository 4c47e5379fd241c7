"""POST /v1/rerank (also /rerank and /v2/rerank) at the gateway: LiteLLM's
rerank route, each reranker a `hosted_vllm/` deployment on the engine
(gateway/litellm_config.py), with the checks LiteLLM does not make.

LiteLLM answers a malformed body or an unknown model with a 500, so the body
is checked here against the engine's own request model and the name against
the rerankers (`rerank_refusal`, pure). Ollama has no rerank API, so there is
no fallback: where the engine cannot answer (down, restarting), the client
gets a 503 that says so, with Retry-After, instead of LiteLLM's 500; the
engine's own refusals (400, 404, 429) pass as the engine wrote them
(gateway/app.py's ErrorRewriter).
"""

from __future__ import annotations

from typing import Any

from mlxd.api_errors import INVALID_REQUEST
from mlxd.config import Config

from .errors import JSON, ApiError, send_error, send_json
from .hangup import Replay, read_body
from .routing import RERANK, invalid_for_any_backend, json_object

PATHS = frozenset({"/v1/rerank", "/rerank", "/v2/rerank"})
NO_FALLBACK = ("the MLX engine could not answer the rerank request (down or restarting) and there is no fallback: "
               "Ollama has no rerank API; retry shortly")
RETRY_AFTER_S = 5


def rerank_refusal(body: bytes, config: Config) -> ApiError | None:
    """Why the gateway refuses a rerank request before LiteLLM sees it, or
    None (pure): the body as the fast path reads one, then the name."""
    req = json_object(body)
    if isinstance(req, ApiError):
        return req
    invalid = invalid_for_any_backend(RERANK, req)
    if invalid is not None:
        message, code, param = invalid
        return ApiError(400, message, code, param=param)
    name = req["model"]
    if name in config.rerankers:
        return None
    names = ", ".join(sorted(config.rerankers)) or "none is configured"
    if name in config.embeddings or config.resolve(name) is not None:
        return ApiError(400, f"{name!r} is not a reranker; /v1/rerank takes a reranker ({names})", INVALID_REQUEST,
                        param="model")
    return ApiError(404, f"the reranker {name[:100]!r} does not exist here (rerankers: {names})", "model_not_found",
                    param="model")


class _NoFallback:
    """Wraps `send`: LiteLLM's 5xx for a rerank request becomes the 503 above."""

    def __init__(self, send: Any) -> None:
        self.send = send
        self.replaced = False

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 500:
            self.replaced = True
            error = ApiError(503, NO_FALLBACK, "engine_unavailable")
            await send_json(self.send, 503, error.body(), [JSON, (b"retry-after", str(RETRY_AFTER_S).encode())])
            return
        if not self.replaced:
            await self.send(message)


class RerankRoute:
    """ASGI: rerank requests checked, then LiteLLM's; anything else passes."""

    def __init__(self, app: Any, config: Config) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return  # the client went away
        refusal = rerank_refusal(body, self.config)
        if refusal is not None:
            await send_error(send, refusal)
            return
        await self.app(scope, Replay(body, receive), _NoFallback(send))
