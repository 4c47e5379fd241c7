"""The engine fast path: light-model requests skip LiteLLM's per-chunk work.

Measured (bench/gateway_overhead.py, tiny demo model): through LiteLLM every
streamed chunk is parsed by the openai SDK, rebuilt by LiteLLM's stream
wrapper and serialised again -- about 450 us of gateway CPU a chunk, +14 ms
TTFT and 0.82x throughput; no LiteLLM setting changes that. So this ASGI
wrapper that sits where KeyGuard hands the (authenticated) request
to LiteLLM's app. A POST /v1/chat/completions or /v1/completions whose
`model` routes to the engine (plan_routes: engine_model is not None) goes
straight to the engine over a pooled aiohttp connection; the engine's bytes
are relayed as they arrive (no per-chunk parsing). Anything else, and every
request the engine does not answer with 200 *before its first byte*
(connection refused/reset, 4xx/5xx: the engine sends its headers with the
first token), is replayed to LiteLLM unchanged, so the fallbacks (Ollama on
stop, crash, busy, quarantine) behave exactly as before. A failure after the
first byte is an explicit SSE error event and no [DONE], as the tests require.
LiteLLM still does every fallback; `gateway.engine_fast_path = false` turns
this off.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from mlxd.config import Config
from mlxd.gateway.litellm_config import OLLAMA_SUFFIX, plan_routes

PATHS = {"/v1/chat/completions": "/v1/chat/completions", "/chat/completions": "/v1/chat/completions",
         "/v1/completions": "/v1/completions", "/completions": "/v1/completions"}
HOP = {b"transfer-encoding", b"connection", b"keep-alive", b"content-length", b"date", b"server"}


# Engine 400 codes that mean the input is wrong (as opposed to "this engine
# cannot": model_too_large, request_quarantined, unsupported_parameter,
# context_length_exceeded -- for those the request goes on to Ollama).
CLIENT_MISTAKES = frozenset({"invalid_request", "invalid_messages"})


def _error_code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def _send_error(send: Any, status: int, message: str, code: str, param: str | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _invalid_for_any_backend(path: str, req: dict) -> tuple[str, str] | None:
    """(message, code) when the body is malformed (the engine's own request
    models decide); None when valid, or when only the engine's limits are
    hit (n > 1, a structured response_format...): Ollama may serve those."""
    from pydantic import ValidationError

    from mlxd.engine.protocol import ChatCompletionRequest, CompletionRequest, describe_validation_errors

    model = ChatCompletionRequest if path == "/v1/chat/completions" else CompletionRequest
    try:
        model.model_validate(req)
    except ValidationError as exc:
        message, _, code = describe_validation_errors(exc.errors())
        return None if code == "unsupported_parameter" else (message, code)
    except (RecursionError, ValueError, TypeError):
        return "the request body could not be read", "invalid_request"
    return None


def _unfit_for_ollama(path: str, req: dict) -> str | None:
    """Why LiteLLM's Ollama provider cannot take this (valid) request -- it
    would answer 500 -- or None (pure)."""
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


class _Substitute:
    """Wraps `send`: a 5xx from LiteLLM is replaced by the engine's 4xx."""

    def __init__(self, send: Any, status: int, body: bytes) -> None:
        self.send, self.status, self.body = send, status, body
        self.replaced = False

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 500:
            self.replaced = True
            await self.send({"type": "http.response.start", "status": self.status,
                             "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(self.body)).encode())]})
            await self.send({"type": "http.response.body", "body": self.body})
            return
        if self.replaced:
            return  # the rest of LiteLLM's error body
        await self.send(message)


class EngineFastPath:
    def __init__(self, app: Any, config: Config, heavy: dict[str, bool]) -> None:
        self.app = app
        self.base = f"http://127.0.0.1:{config.engine.port}"
        # public name -> the name to send to the engine (None: leave as is)
        self.routes: dict[str, str | None] = {}
        # every name LiteLLM serves: the routes, and their explicit Ollama twins
        self.known: set[str] = set()
        for r in plan_routes(config, heavy):
            self.known.add(r.name)
            if r.engine_model is None:
                continue
            if r.ollama_model:
                self.known.add(r.name + OLLAMA_SUFFIX)
            same = config.resolve(r.name) == r.engine_model
            self.routes[r.name] = None if same else r.engine_model
        self.session: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5), auto_decompress=False)
        return self.session

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = PATHS.get(scope.get("path", "")) if scope["type"] == "http" and scope.get("method") == "POST" else None
        if path is None:
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)

        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the real channel (disconnects)
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            req = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            req = None
        if not isinstance(req, dict):  # LiteLLM would answer a bare 500: it is the input's fault
            await _send_error(send, 400, "the request body must be a JSON object" if req is not None or body.strip()
                              else "the request body is empty", "invalid_request")
            return
        invalid = _invalid_for_any_backend(path, req)
        if invalid is not None:  # LiteLLM does not validate bodies: it would answer 500
            await _send_error(send, 400, invalid[0], invalid[1])
            return
        name = req.get("model")
        if not isinstance(name, str) or name not in self.known:
            # Only configured names: LiteLLM would otherwise read "a,b" as a
            # fan-out to several models and answer 200 with a list of errors.
            await _send_error(send, 404, f"the model {str(name)[:100]!r} does not exist here; GET /v1/models "
                                         "lists the models this gateway serves", "model_not_found", "model")
            return
        if name not in self.routes:  # served by Ollama through LiteLLM
            refusal = _unfit_for_ollama(path, req)
            if refusal is not None:
                await _send_error(send, 400, refusal, "unsupported_parameter")
                return
            await self.app(scope, replay, send)
            return
        engine_name = self.routes[name]
        out_body = body
        if engine_name is not None:
            req["model"] = engine_name
            out_body = json.dumps(req).encode()
        try:
            resp = await self._session().post(self.base + path, data=out_body,
                                              headers={"Content-Type": "application/json"})
        except (aiohttp.ClientError, OSError):
            await self.app(scope, replay, send)  # engine down: LiteLLM falls back
            return
        if resp.status != 200:
            answer = await resp.read()
            resp.release()
            if resp.status == 400 and _error_code(answer) in CLIENT_MISTAKES:
                # Malformed input: Ollama would not do better, and LiteLLM would
                # turn some of it into a 500. The engine's 400 says what is wrong.
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(answer)).encode())]})
                await send({"type": "http.response.body", "body": answer})
                return
            # Busy, quarantined, refused...: LiteLLM falls back. If all it can
            # make of a request the engine refused with a 4xx is a 500 (it
            # does not validate bodies), the engine's answer stands.
            fallback_send = _Substitute(send, resp.status, answer) if 400 <= resp.status < 500 else send
            await self.app(scope, replay, fallback_send)
            return
        headers = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in HOP]
        watcher: asyncio.Future | None = None
        streaming = resp.headers.get("content-type", "").startswith("text/event-stream")
        try:
            if not streaming:
                try:
                    data = await resp.read()
                except (aiohttp.ClientError, OSError):
                    await self.app(scope, replay, send)  # died mid-answer: nothing sent yet, fall back
                    return
                if engine_name is not None:  # the client sees the name it asked for
                    doc = json.loads(data)
                    doc["model"] = name
                    data = json.dumps(doc).encode()
                await send({"type": "http.response.start", "status": 200,
                            "headers": headers + [(b"content-length", str(len(data)).encode())]})
                await send({"type": "http.response.body", "body": data})
                return
            await send({"type": "http.response.start", "status": 200, "headers": headers})

            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                resp.close()  # the engine sees the disconnect and stops generating

            watcher = asyncio.ensure_future(watch_disconnect())
            old = f'"model": "{engine_name}"'.encode() if engine_name else None
            new = f'"model": "{name}"'.encode()
            try:
                async for data in resp.content.iter_any():
                    if old:
                        data = data.replace(old, new)
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            except (aiohttp.ClientError, OSError) as exc:
                err = {"error": {"message": f"the engine failed mid-stream ({type(exc).__name__}); the answer is "
                                            "incomplete", "type": "service_unavailable_error", "param": None,
                                 "code": "engine_failed_mid_stream"}}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(err)}\n\n".encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            if watcher is not None:
                watcher.cancel()
            resp.release()  # a client that went away: closing the upstream stops the engine's generation
