"""The engine's HTTP app: FastAPI routes over the engine's parts.

`Engine` wires the parts once, each the one owner of its state: the
AdmissionQueue owns the line, the Lifecycle the process (start, drain,
fatal exit) and with it the model worker, which owns the model; Health
owns the unhealthy verdict; the RequestRelay answers requests. Handlers
validate, then hand over to the relay; they never touch MLX.
"""

from __future__ import annotations

from typing import Any

import asyncio
import logging
import shutil
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxd.config import Config
from mlxd.durations import parse_duration
from mlxd.host_check import ANY_HOST, HostCheck
from mlxd.keyfile import KeyFile, authorization_key, matches
from mlxd.memory_estimate import GIB, disk_tier_budget

from ..core.admission import AdmissionQueue
from ..core.embedding_queue import EmbeddingQueue
from ..model.errors import EngineError
from ..model.faults import FaultInjector
from .health import Health
from ..model.job import Job
from ..cache.kv_files import KVFiles
from .lifecycle import Lifecycle
from .metrics import CONTENT_TYPE, EngineMetrics, register_gauges
from ..model.model_registry import ModelRegistry
from ..model.prefill_pace import default_step_size
from ..cache.prompt_cache import PromptCache
from .quarantine import QuarantineList
from .relay import ClientGone, RequestRelay
from .embeddings_api import answer_embeddings
from .rerank_api import answer_rerank
from .messages_api import MessagesRequest
from .messages_api import to_chat_request as messages_to_chat
from .messages_builder import MessagesBuilder
from .request_schema import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, RerankRequest,
                             describe_validation_errors)
from .responses_api import ResponsesRequest
from .responses_to_chat import TranslationError, input_messages, to_chat_request
from .responses_builder import ResponsesBuilder
from .responses_store import OWNER_HEADER, ResponseStore, owner_of
from .set_aside import SetAsideMiddleware
from ..cache.reuse import ApproxPolicy
from ..core.worker import ModelWorker

log = logging.getLogger("mlxd.engine")


def make_prompt_cache(config: Config, faults: FaultInjector, registry: ModelRegistry) -> PromptCache:
    """The prompt cache as configured (built on the worker thread)."""
    pc = config.engine.prompt_cache
    files = None
    if pc.enabled and pc.disk:
        config.paths.kv.mkdir(parents=True, exist_ok=True)
        memory_tier = max((registry.info(m).prompt_cache_bytes for m in config.models), default=0)
        disk_bytes = disk_tier_budget(None if pc.disk_gib is None else int(pc.disk_gib * GIB), memory_tier,
                                      shutil.disk_usage(config.paths.kv).free)
        files = KVFiles(config.paths.kv, disk_bytes, config.models, lambda: faults.check("kv_write"))
    return PromptCache(pc.enabled, files, pc.max_read_s, ApproxPolicy() if pc.approximate else None)


class Engine:
    """The engine's parts, wired once."""

    def __init__(self, config: Config, registry: ModelRegistry, faults: FaultInjector, link: Any = None) -> None:
        """`link`: rank 0's RankLink in a rank group (engine/model/ranks.py), else None."""
        limits, paths = config.engine, config.paths
        paths.run.mkdir(parents=True, exist_ok=True)
        self.registry = registry
        # busy_spill: a busy engine answers 429 at once, and the gateway sends
        # the request to Ollama instead of letting it wait here.
        self.admission: AdmissionQueue[Job] = AdmissionQueue(0 if config.gateway.busy_spill else limits.max_queue,
                                                             slots=1 if link is not None else registry.most_concurrency())
        default = config.resolve(limits.default_model)
        # Embedding requests: a short line of their own, served between the chat requests' steps.
        self.embeddings = EmbeddingQueue(self.admission.wake)
        self.lifecycle = Lifecycle(self.admission, limits.shutdown_grace_s, lambda on_fatal: ModelWorker(
            registry, self.admission, faults, on_fatal, limits.max_prompt_tokens, default, paths.inflight,
            default_step_size(limits.prefill_step_size, registry.on_cuda),
            # A rank group keeps no prompt cache: rank 0's KV is only its shard of it.
            (lambda: make_prompt_cache(config, faults, registry)) if link is None else None, link, limits.stuck_grace_s,
            self.embeddings), self.embeddings)
        self.health = Health(self.lifecycle, self.admission, registry.budget_bytes, limits.stuck_grace_s)
        self.metrics = EngineMetrics()
        register_gauges(self.metrics, self.lifecycle.worker, self.admission, lambda: self.health.state()[0] == "ok")
        self.relay = RequestRelay(limits, registry, QuarantineList(paths.quarantine), self.admission,
                                  self.lifecycle, self.health, self.metrics)
        self.responses = ResponseStore(paths.responses, ttl_s=parse_duration(config.engine.stored_responses_ttl))

    async def respond(self, request: Request, body: ResponsesRequest) -> Response:
        """POST /v1/responses: the request as a chat job, after the stored
        conversation it continues (the caller's own); its answer stored, the
        caller's, unless store is false."""
        owner = request_owner(request)
        history = self.responses.conversation(body.previous_response_id, owner) if body.previous_response_id else []
        try:
            chat = to_chat_request(body, history)
        except TranslationError as exc:
            raise EngineError(400, exc.message, code=exc.code, param=exc.param) from None

        def store(response: dict, answer: dict) -> None:
            self.responses.put(response, [*history, *input_messages(body.input), answer], owner)

        return await self.relay.answer(request, chat, "chat",
                                       lambda _: ResponsesBuilder(body, on_complete=store if body.store else None))

    async def message(self, request: Request, body: MessagesRequest) -> Response:
        """POST /v1/messages: Anthropic's request as a chat job, answered in Anthropic's shape."""
        try:
            chat = messages_to_chat(body)
        except TranslationError as exc:
            raise EngineError(400, exc.message, code=exc.code, param=exc.param) from None
        return await self.relay.answer(request, chat, "chat",
                                       lambda started: MessagesBuilder(body, started))


# --- the FastAPI app -----------------------------------------------------------

def error_response(err: EngineError, path: str = "") -> JSONResponse:
    """The error in the shape of the route at `path` (Anthropic's on /v1/messages, else OpenAI's)."""
    return JSONResponse(err.body(path), status_code=err.status, headers=err.headers())


class RequestCounter:
    """Counts answers by route and status. A plain ASGI middleware: starlette's
    BaseHTTPMiddleware would hide client disconnects from the handlers."""

    ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
              "/v1/rerank", "/v1/models", "/health", "/metrics")

    def __init__(self, app, metrics: EngineMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [499]  # unless a response starts, the client went away

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope["path"] if scope["path"] in self.ROUTES else "other"
            self.metrics.requests.labels(route, str(status[0])).inc()


class KeyCheck:
    """Every request but GET /livez (a liveness probe that says nothing but
    "alive") must carry the engine's key, as `Authorization: Bearer` (or
    Basic, the key as the password); else 401 in OpenAI's shape. The key
    file is read again when `mlxd key rotate` renews it. A plain ASGI
    middleware, as above."""

    OPEN = (("GET", "/livez"), ("HEAD", "/livez"))

    def __init__(self, app, key: KeyFile) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) not in self.OPEN:
            headers = dict(scope.get("headers") or [])
            given = authorization_key(headers.get(b"authorization", b"").decode("latin-1"))
            key = self.key.current()
            if key is None or not matches(given, key):
                response = error_response(EngineError(401, "this engine requires its key: send 'Authorization: "
                                                           "Bearer <key>' with the key in $MLXD_HOME/engine.key",
                                                      code="invalid_api_key"), scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine, key: KeyFile, host_names: frozenset[str] = frozenset({ANY_HOST})) -> FastAPI:
    """The app: requests must carry the key in `key` (KeyCheck) and name one
    of `host_names` in their Host header (mlxd.host_check)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.lifecycle.start()
        yield
        await asyncio.to_thread(engine.lifecycle.stop, 5.0)

    app = FastAPI(title="mlxd engine", version="0.1.0", lifespan=lifespan)
    # Starlette runs the last added first: the key check, then hosted tools out of the body (named in a header).
    app.add_middleware(SetAsideMiddleware)
    app.add_middleware(KeyCheck, key=key)
    app.add_middleware(RequestCounter, metrics=engine.metrics)  # 401s count too
    app.add_middleware(HostCheck, names=host_names, setting="[engine] allowed_hosts")  # added last: runs first

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        engine.metrics.rejections.labels(exc.code).inc()
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # An engine limit (request_fields.Unsupported) is not the client's
        # mistake: its code sends the gateway on to Ollama (malformed input's does not).
        message, param, code = describe_validation_errors(exc.errors())
        return error_response(EngineError(400, message, code=code, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        status = exc.status_code if 400 <= exc.status_code < 500 else 400
        return error_response(EngineError(status, str(exc.detail), code=code), request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error answering %s", request.url.path)
        return error_response(EngineError(500, f"internal error: {type(exc).__name__}", code="internal_error"),
                              request.url.path)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await engine.relay.answer(request, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await engine.relay.answer(request, body, "completion")

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await engine.respond(request, body)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await engine.message(request, body)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict:
        engine.lifecycle.request_opened()  # a fatal exit lets its answer out first
        try:
            return await answer_embeddings(body, engine.registry.config, engine.embeddings,
                                           engine.registry.config.engine.request_deadline_s)
        finally:
            engine.lifecycle.request_closed()

    async def rerank(body: RerankRequest) -> dict:
        engine.lifecycle.request_opened()
        try:
            return await answer_rerank(body, engine.registry.config, engine.embeddings,
                                       engine.registry.config.engine.request_deadline_s)
        finally:
            engine.lifecycle.request_closed()

    # Cohere's v2 and v1 paths, Jina's, vLLM's: one route, documented once.
    app.post("/v1/rerank")(rerank)
    for path in ("/rerank", "/v2/rerank"):
        app.post(path, include_in_schema=False)(rerank)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request) -> dict:
        found = engine.responses.response(response_id, request_owner(request))
        if found is None:
            raise not_stored(response_id)
        return found

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        if not engine.responses.delete(response_id, request_owner(request)):
            raise not_stored(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.get("/v1/models")
    async def models() -> dict:
        # The resident model says who renders its tools: the chat template, or mlxd where the template drops them.
        worker = engine.lifecycle.worker
        resident, tools = worker.status.resident_model, worker.resident_tools
        rows = [row | {"tools": tools} if tools and (row.get("alias_of") or row["id"]) == resident else row
                for row in engine.registry.listing()]
        return {"object": "list", "data": rows}

    @app.get("/livez")
    async def livez() -> dict:
        return {"status": "alive"}  # open (KeyCheck.OPEN): nothing more than that

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = engine.health.report()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    return app


def request_owner(request: Request) -> str:
    """Who a request is, for the stored responses (responses_store.owner_of)."""
    owner = owner_of(request.headers.get(OWNER_HEADER))
    if owner is None:
        raise EngineError(400, f"the {OWNER_HEADER} header must be a hex digest (the gateway's hash of a key)",
                          code="invalid_request", param=OWNER_HEADER)
    return owner


def not_stored(response_id: str) -> EngineError:
    return EngineError(404, f"no stored response with id {response_id[:120]!r}", code="not_found", param="response_id")
