"""The fast path's decisions (pure): where a request goes (refused, to
LiteLLM, to the engine), what the client sees after the engine refuses, and
the model name in relayed bytes. gateway/fastpath.py does the I/O."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum

from mlxd.api_errors import CLIENT_MISTAKES, INVALID_REQUEST, UNSUPPORTED_PARAMETER
from mlxd.config import Config

from .errors import FALLBACK_FAILED, ApiError, fallback_note
from .litellm_config import OLLAMA_SUFFIX, plan_embedding_routes, plan_routes

# Client path -> the engine's path, for the requests the fast path takes.
ENGINE_PATHS = {"/v1/chat/completions": "/v1/chat/completions", "/chat/completions": "/v1/chat/completions",
                "/v1/completions": "/v1/completions", "/completions": "/v1/completions",
                "/v1/responses": "/v1/responses", "/responses": "/v1/responses",
                "/v1/messages": "/v1/messages",
                "/v1/embeddings": "/v1/embeddings", "/embeddings": "/v1/embeddings"}
EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"  # gateway/rerank.py's: checked here as the others, then LiteLLM's route
MESSAGES = "/v1/messages"  # Anthropic's Messages API: its errors, in the gateway too, have Anthropic's shape


@dataclass(frozen=True)
class FastRoutes:
    engine: dict[str, str | None]  # public name -> the name the engine gets (None: the same)
    known: frozenset[str]  # every name LiteLLM serves: the routes and their explicit Ollama twins
    ollama_only: frozenset[str] = frozenset()  # names no engine serves (heavy models): Ollama answers
    embedding: frozenset[str] = frozenset()  # embedding models' names (/v1/embeddings), on the local engine

    @classmethod
    def plan(cls, config: Config, heavy: dict[str, bool]) -> FastRoutes:
        engine: dict[str, str | None] = {}
        known: set[str] = set()
        ollama_only: set[str] = set()
        for r in plan_routes(config, heavy):
            known.add(r.name)
            if r.engine_model is None:
                ollama_only.add(r.name)
                continue
            if r.ollama_model:
                known.add(r.name + OLLAMA_SUFFIX)
            if r.engine_urls != (config.engine_url,):
                continue  # several or other hosts: LiteLLM's router picks the engine
            engine[r.name] = None if config.resolve(r.name) == r.engine_model else r.engine_model
        embedding = set()
        for r in plan_embedding_routes(config):
            embedding.add(r.name)
            known.update((r.name, r.name + OLLAMA_SUFFIX))
            engine[r.name] = None
        return cls(engine, frozenset(known), frozenset(ollama_only), frozenset(embedding))


@dataclass(frozen=True)
class ToLiteLLM:
    """Served by Ollama through LiteLLM; the body goes on unchanged."""


@dataclass(frozen=True)
class ToEngine:
    body: bytes  # what the engine gets
    public_name: str  # what the client asked for, and sees in the answer
    engine_name: str | None  # the name the engine answers with, when it differs
    # The engine's answer stands, whatever it is, and an engine that cannot be
    # reached is a 503: a Responses request continuing a conversation that only
    # the engine holds (previous_response_id), which Ollama would answer without.
    stays: bool = False


def invalid_for_any_backend(path: str, req: dict) -> tuple[str, str, str | None] | None:
    """(message, code, param) when the body is malformed (the engine's own request
    models decide); None when valid, or when only the engine's limits are
    hit (n > 1, a structured response_format...): Ollama may serve those.
    Not so for the Responses API: what its model refuses as unsupported
    (hosted tools, background, prompt templates, conversations, logprobs,
    item references, files) LiteLLM's Responses-to-chat bridge for Ollama
    drops without a word (measured on 1.108.7), so those are refused here.
    Anthropic's Messages API is as chat: what its model refuses as
    unsupported (a PDF, an image in a tool result) LiteLLM's adapter may
    still give Ollama."""
    from pydantic import ValidationError

    from mlxd.engine.api.messages_api import MessagesRequest
    from mlxd.engine.api.request_schema import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                                RerankRequest, describe_validation_errors)
    from mlxd.engine.api.responses_api import ResponsesRequest

    model = {"/v1/chat/completions": ChatCompletionRequest, "/v1/responses": ResponsesRequest,
             MESSAGES: MessagesRequest, EMBEDDINGS: EmbeddingRequest, RERANK: RerankRequest}.get(path, CompletionRequest)
    try:
        model.model_validate(req)
    except ValidationError as exc:
        message, param, code = describe_validation_errors(exc.errors())
        return None if code == UNSUPPORTED_PARAMETER and model is not ResponsesRequest else (message, code, param)
    except (RecursionError, ValueError, TypeError):
        return "the request body could not be read", INVALID_REQUEST, None
    return None


def unfit_for_ollama(path: str, req: dict) -> str | None:
    """Why LiteLLM's Ollama provider cannot take this (valid) request -- it
    would answer 500 -- or None."""
    if path == "/v1/completions" and isinstance(req.get("prompt"), list) and req["prompt"] \
            and not isinstance(req["prompt"][0], str):
        return "a prompt of token ids needs the MLX engine; this model is served by Ollama: send text"
    for i, message in enumerate(req.get("messages") or []):
        for j, call in enumerate(message.get("tool_calls") or []):
            args = call.get("function", {}).get("arguments")
            if isinstance(args, str) and args.strip():
                try:
                    json.loads(args)
                except ValueError:
                    return (f"messages[{i}].tool_calls[{j}].function.arguments is not JSON; this model is served "
                            "by Ollama, which needs JSON arguments")
    return None


def json_object(body: bytes) -> dict | ApiError:
    """A request body read as a JSON object, or the 400 that says why it is not (pure)."""
    try:
        req = json.loads(body)
    except RecursionError:  # arrays and objects nested past the parser's depth (~1,000 levels): said as such
        return ApiError(400, "the request body nests JSON arrays and objects too deep (about 1,000 levels or more)",
                        INVALID_REQUEST)
    except ValueError as exc:
        return ApiError(400, f"the request body is not valid JSON ({str(exc)[:200]})" if body.strip()
                        else "the request body is empty", INVALID_REQUEST)
    if not isinstance(req, dict):
        return ApiError(400, "the request body must be a JSON object", INVALID_REQUEST)
    return req


def route_request(path: str, body: bytes, routes: FastRoutes) -> ApiError | ToLiteLLM | ToEngine:
    """Where a POST to an ENGINE_PATHS value goes. LiteLLM does not validate
    bodies (it answers bad ones with a 500), so malformed input is refused here."""
    req = json_object(body)
    if isinstance(req, ApiError):
        return req
    invalid = invalid_for_any_backend(path, req)
    if invalid is not None:
        message, code, param = invalid
        return ApiError(400, message, code, param=param)
    name = req.get("model")
    if not isinstance(name, str) or name not in routes.known:
        # Only configured names: LiteLLM would otherwise read "a,b" as a
        # fan-out to several models and answer 200 with a list of errors.
        return ApiError(404, f"the model {str(name)[:100]!r} does not exist here; GET /v1/models lists the models "
                             "this gateway serves", "model_not_found", param="model")
    if (path == EMBEDDINGS) != (name.removesuffix(OLLAMA_SUFFIX) in routes.embedding):
        listed = ", ".join(sorted(routes.embedding)) or "none is configured"
        return ApiError(400, f"{name!r} is an embedding model: send it to /v1/embeddings" if path != EMBEDDINGS else
                        f"{name!r} is a chat model; /v1/embeddings takes an embedding model ({listed})",
                        INVALID_REQUEST, param="model")
    continues = path == "/v1/responses" and req.get("previous_response_id") is not None
    if continues and name in routes.ollama_only:
        return ApiError(400, f"previous_response_id needs the MLX engine, which stores responses; the model {name!r} "
                             "is served by Ollama through LiteLLM, which keeps none: send the whole conversation as "
                             "input", UNSUPPORTED_PARAMETER, param="previous_response_id")
    if name not in routes.engine:
        refusal = unfit_for_ollama(path, req)
        return ToLiteLLM() if refusal is None else ApiError(400, refusal, UNSUPPORTED_PARAMETER)
    engine_name = routes.engine[name]
    if engine_name is None:
        return ToEngine(body, name, None, continues)
    return ToEngine(json.dumps({**req, "model": engine_name}).encode(), name, engine_name, continues)


# The supervisor's modes (supervisor/policy.py) in which no restart is coming, and those of a restart under way.
NO_RESTART_MODES = ("stopped", "degraded")
RESTART_MODES = ("starting", "backoff")


def engine_restarting(mode: str | None, crash_times: list[float], last_exit: float | None, now: float,
                      window_s: float) -> bool:
    """Whether the supervisor is bringing the engine back after a crash (pure):
    waiting out its backoff or starting it, or it started after a crash less
    than `window_s` ago (the new process may still be importing and loading:
    supervisord calls it running from its spawn), or the engine died less
    than `window_s` ago (`last_exit`: the runner's record of its exit, or the
    gateway's own sight of it dying under a request, which comes first when a
    dying process takes seconds to go) and the listener has not said so yet."""
    if mode in RESTART_MODES:
        return True
    recent = [t for t in (*crash_times, last_exit) if t is not None]
    return mode == "running" and bool(recent) and now - max(recent) < window_s


# A request lost at a crash with others (a batch: the engine's quarantine blames none of them, and decodes each
# alone from then on) is sent to the restarted engine twice at most: retried with the one that crashed it, a
# bystander may queue behind that one's lone retry and be lost again at its second crash, which quarantines the
# culprit (its third try is refused, and goes to Ollama). A request lost alone is sent once: it is the likely
# culprit, and a crash the quarantine cannot pin (before the request was in flight) must not repeat.
MAX_RESTART_RETRIES = 2
# The second retry waits only for a restart due this soon (the supervisor's backoff), and for the engine's
# health at most SECOND_RETRY_WAIT_S: past them Ollama answers.
SECOND_RETRY_WITHIN_S = 5.0
SECOND_RETRY_WAIT_S = 15.0
SAME_CRASH_S = 1.0  # requests lost this close together were lost at the same crash


def hold_for_restart(lost_in_flight: bool, retries: int, supervision_mode: str | None, restarting: bool,
                     wait_s: float, first_loss_shared: bool = False, restart_in_s: float | None = None) -> bool:
    """Whether a request the engine could not take is held for the engine's
    restart and sent to it (pure), rather than to Ollama: one the engine
    died under before its answer started, or one that found it down while a
    restart after a crash is under way (`restarting`) -- a few seconds'
    wait for its own model, not another model's answer in the middle of an
    agent's conversation. Once; a second time only where it was lost at its
    first crash with others (`first_loss_shared`) and the restart is due
    within SECOND_RETRY_WITHIN_S (`restart_in_s`: the supervisor's backoff;
    None: not waiting one out). Never while no restart is coming (stopped by
    an operator, a crash loop's cool-down): a refused connection then, or
    outside a restart, is Ollama's at once."""
    if retries >= MAX_RESTART_RETRIES or wait_s <= 0 or supervision_mode in NO_RESTART_MODES:
        return False
    if retries and (not first_loss_shared or (restart_in_s is not None and restart_in_s > SECOND_RETRY_WITHIN_S)):
        return False
    return lost_in_flight or restarting


def lost_together(at: float, losses: list[float]) -> bool:
    """Whether a request lost at `at` was lost with another (pure): `losses`,
    the times the gateway's requests were lost to the engine, its own among them."""
    return sum(1 for t in losses if abs(t - at) <= SAME_CRASH_S) >= 2


class AfterRefusal(Enum):
    """What the client sees after the engine answers anything but 200."""

    ENGINE_ANSWER = "the engine's 400 stands: the input is wrong and Ollama would not do better"
    FALL_BACK = "LiteLLM falls back to Ollama"
    FALL_BACK_UNLESS_500 = "LiteLLM falls back; if all it makes of it is a 5xx, the engine's 4xx stands"


def after_refusal(status: int, body: bytes, path: str = "/v1/chat/completions") -> AfterRefusal:
    """Decided on the error's code, never its wording: the engine's 400 stands
    for a client's mistake (mlxd.api_errors.CLIENT_MISTAKES); "this engine
    cannot" (unsupported_parameter, model_too_large, request_quarantined,
    context_length_exceeded) and every other refusal go on to Ollama. Except
    an embedding input over the model's limit: Ollama's twin is the same
    model, and would cut the input without a word."""
    code = _error_code(body)
    if status == 400 and (code in CLIENT_MISTAKES or (path == EMBEDDINGS and code == "context_length_exceeded")):
        return AfterRefusal.ENGINE_ANSWER
    return AfterRefusal.FALL_BACK_UNLESS_500 if 400 <= status < 500 else AfterRefusal.FALL_BACK


def stream_failure(path: str, error: ApiError) -> bytes:
    """The last event of a stream the engine broke off (pure): an `error`
    event in the Responses API's shape on /v1/responses and in Anthropic's on
    /v1/messages (what their clients read), else the error object as a chat
    stream's data line (no [DONE])."""
    if path == MESSAGES:
        return b"event: error\ndata: " + error.body(path) + b"\n\n"
    if path == "/v1/responses":
        body = json.loads(error.body())["error"]
        event = {"type": "error", "code": body["code"], "message": body["message"], "param": body.get("param"),
                 "sequence_number": 0}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    return b"data: " + error.body() + b"\n\n"


def failed_fallback_note(fallback_body: bytes) -> bytes:
    """What the failed fallback said, for the `x-mlxd-fallback` header beside
    the engine's refusal, which the client gets as the engine wrote it (pure)."""
    try:
        said = str(json.loads(fallback_body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        said = fallback_body.decode(errors="replace")
    failed = FALLBACK_FAILED.search(said)  # LiteLLM tried the engine again first: the fallback's own words
    return fallback_note(failed.group(1), failed.group(2)) if failed else fallback_note("the Ollama fallback", said)


def _error_code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def rename_model(answer: bytes, public_name: str) -> bytes:
    """A whole (non-streamed) answer with the name the client asked for."""
    doc = json.loads(answer)
    doc["model"] = public_name
    return json.dumps(doc).encode()


class StreamRenamer:
    """Rewrites `"model": "<engine name>"` to the public name in relayed SSE
    bytes. Only whole lines are rewritten (a partial one waits for the next
    chunk), so the result does not depend on how the network splits the
    stream, and any JSON spacing matches. Content cannot match: inside a JSON
    string its quotes are escaped."""

    def __init__(self, engine_name: str, public_name: str) -> None:
        self.pattern = re.compile(rb'("model"\s*:\s*)' + re.escape(json.dumps(engine_name).encode()))
        self.replacement = rb"\g<1>" + json.dumps(public_name).encode().replace(b"\\", b"\\\\")
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        whole, newline, self.pending = (self.pending + data).rpartition(b"\n")
        return self.pattern.sub(self.replacement, whole + newline)

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return self.pattern.sub(self.replacement, rest)
