"""The engine fast path: light-model requests skip LiteLLM's per-chunk work.

Through LiteLLM every streamed chunk is parsed by the openai SDK, rebuilt by
LiteLLM's stream wrapper and serialised again, and no LiteLLM setting
changes that (the cost measured: docs/BENCHMARKS.md). So this ASGI wrapper
sits where KeyGuard hands the (authenticated) request to LiteLLM's
app. A POST /v1/chat/completions, /v1/completions, /v1/responses,
/v1/embeddings or Anthropic's /v1/messages whose `model` routes to the
engine (gateway/routing.py decides) goes straight to the engine over a
pooled aiohttp connection; the engine's bytes are relayed as they arrive (no
per-chunk parsing; an alias renamed for the engine gets its public name back
line by line). Anything else, and every
request the engine does not answer with 200 *before its first byte*
(connection refused/reset, 4xx/5xx: the engine sends its headers with the
first token), is replayed to LiteLLM unchanged, so the fallbacks (Ollama on
stop, crash, busy, quarantine) behave exactly as before. A failure after the
first byte is an explicit SSE error event and no [DONE], as the tests require.
An engine that dies with a request in flight before its answer started is
not the fallback's at once: the request is held while the supervisor brings
the engine back (`gateway.crash_retry_wait_s`; routing.hold_for_restart
decides) and sent to it again (twice where it was lost with others), so an
agent's turn is answered by its own model, from its prompt's KV on disk, a
few seconds later; so is one
that finds the engine down while such a restart is under way.
LiteLLM still does every fallback; `gateway.engine_fast_path = false` turns
this off. One exception: a Responses API request with previous_response_id
continues a conversation only the engine stores, so it stays with the engine
(its refusals stand; unreachable, a 503): LiteLLM's Ollama bridge would answer
it without the conversation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from mlxd.config import Config
from mlxd.keyfile import KeyFile, owner_headers
from mlxd.records import EngineExit, SupervisionFile

from .errors import FALLBACK_HEADER, JSON, ApiError, send_error, send_json
from .hangup import Replay, read_body
from .routing import (ENGINE_PATHS, NO_RESTART_MODES, SECOND_RETRY_WAIT_S, AfterRefusal, FastRoutes, StreamRenamer,
                      ToEngine, after_refusal, engine_restarting, failed_fallback_note, hold_for_restart,
                      lost_together, rename_model, route_request, stream_failure)

log = logging.getLogger("mlxd.gateway")
RESTART_POLL_S = 0.2  # how often a held request looks for the engine back
EXIT_RECORD_GRACE_S = 0.3  # a refused request in "running" looks again for the exit that refused it

HOP = {b"transfer-encoding", b"connection", b"keep-alive", b"content-length", b"date", b"server"}
MID_STREAM_FAILURE = "the engine failed mid-stream ({}); the answer is incomplete"
# A request that stays with the engine (ToEngine.stays) when it cannot be reached.
ENGINE_GONE = ApiError(503, "the MLX engine is unavailable (down or restarting) and previous_response_id names a "
                            "conversation only it stores (the Ollama fallback would answer without it): retry "
                            "shortly, or send the whole conversation as input", "engine_unavailable")


class _Substitute:
    """Wraps `send`: when the fallback fails too (LiteLLM answers an error),
    the client gets the engine's refusal as the engine wrote it (its message,
    param and code), what the fallback said in `x-mlxd-fallback`
    (routing.failed_fallback_note), and the engine's `Retry-After` (a busy
    engine's 429 says when to come back)."""

    def __init__(self, send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
        self.send, self.status, self.body = send, status, body
        self.headers = [JSON, *((k, v) for k, v in headers if k.lower() == b"retry-after")]
        self.failed = False
        self.parts: list[bytes] = []

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            self.failed = True
        elif not self.failed:
            await self.send(message)
        elif message["type"] == "http.response.body":  # LiteLLM's error body, held until it is whole
            self.parts.append(message.get("body", b""))
            if not message.get("more_body"):
                await send_json(self.send, self.status, self.body,
                                [*self.headers, (FALLBACK_HEADER, failed_fallback_note(b"".join(self.parts)))])


class EngineFastPath:
    def __init__(self, app: Any, config: Config, heavy: dict[str, bool], engine_key: KeyFile) -> None:
        self.app = app
        self.base = config.engine_url
        self.engine_key = engine_key  # read again when `mlxd key rotate` renews it
        self.routes = FastRoutes.plan(config, heavy)
        self.session: aiohttp.ClientSession | None = None
        self.supervision_path = config.paths.supervision
        self.engine_exit_path = config.paths.engine_exit
        self.retry_wait_s = config.gateway.crash_retry_wait_s
        # When this gateway last saw the engine die under a request (wall clock): a slow death (a CUDA or
        # Metal process tearing down, a crash report being written) closes its sockets a second or more before
        # the process is gone and the runner can record its exit.
        self.engine_died_at: float | None = None
        self.losses: list[float] = []  # when requests were lost to the engine, the last minute's (lost_together)

    def _headers(self, scope: dict) -> dict[str, str]:
        """The engine's key, and who the caller is (KeyGuard's hash) for its stored responses."""
        return {"Content-Type": "application/json", **self.engine_key.headers(),
                **owner_headers(scope.get("headers", ()))}

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5), auto_decompress=False)
        return self.session

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = ENGINE_PATHS.get(scope.get("path", "")) if scope["type"] == "http" and scope.get("method") == "POST" \
            else None
        if path is None:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return
        decision = route_request(path, body, self.routes)
        if isinstance(decision, ApiError):
            await send_error(send, decision, path=path)
        elif isinstance(decision, ToEngine):
            await self._via_engine(scope, path, decision, Replay(body, receive), send)
        else:
            await self.app(scope, Replay(body, receive), send)

    async def _via_engine(self, scope: dict, path: str, to: ToEngine, replay: Replay, send: Any) -> None:
        """The engine answers, unless it does not say 200 before its first
        byte: then LiteLLM gets the request as the client sent it. One the
        engine lost in flight waits for its restart and goes to it again."""
        retries, first_loss = 0, None
        while True:
            lost_in_flight = True
            try:
                resp = await self._session().post(self.base + path, data=to.body, headers=self._headers(scope))
            except aiohttp.ClientConnectorError:
                resp, lost_in_flight = None, False  # refused: the engine is down, not dying under this request
            except (aiohttp.ClientError, OSError):
                resp = None  # it died before its answer's headers (a stream's come with its first token)
                self.engine_died_at = time.time()
            answer: bytes | None = None
            if resp is not None:
                try:
                    headers = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in HOP]
                    if resp.status == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
                        await self._relay_stream(resp, headers, to, send, path)
                        return
                    try:
                        answer = await resp.read()
                    except (aiohttp.ClientError, OSError):
                        answer = None  # died mid-answer: nothing sent yet, so it can still be answered
                        self.engine_died_at = time.time()
                finally:
                    resp.release()
            if answer is None and lost_in_flight:
                now = time.time()
                first_loss = now if first_loss is None else first_loss
                self.losses = [t for t in self.losses if now - t < 60] + [now]
            shared = first_loss is not None and lost_together(first_loss, self.losses)
            if answer is not None or not await self._engine_back(lost_in_flight, retries, shared):
                break
            retries += 1
        if resp is None or answer is None:  # down, or died with it (and not back in time, or twice)
            if to.stays:
                await send_error(send, ENGINE_GONE, [(b"retry-after", b"2")], path)
            else:
                await self.app(scope, replay, send)  # LiteLLM falls back
            return
        if to.stays and resp.status != 200:  # busy, refusing, not found: the engine's answer stands
            await send_json(send, resp.status, answer, headers)
        elif resp.status == 200:
            await send_json(send, 200, rename_model(answer, to.public_name) if to.engine_name else answer, headers)
        else:
            after = after_refusal(resp.status, answer, path)
            if after is AfterRefusal.ENGINE_ANSWER:
                await send_json(send, resp.status, answer)
            else:
                await self.app(scope, replay, _Substitute(send, resp.status, answer, headers)
                               if after is AfterRefusal.FALL_BACK_UNLESS_500 else send)

    async def _engine_back(self, lost_in_flight: bool, retries: int, first_loss_shared: bool = False) -> bool:
        """Whether the engine that lost a request is back to take it again:
        held (routing.hold_for_restart) until its /health says ok, at most
        `crash_retry_wait_s`, while the supervisor is bringing it back."""
        mode, restarting, restart_in_s = self._restarting()
        if mode == "running" and not restarting and not (lost_in_flight or retries) and self.retry_wait_s > 0:
            # Refused while the supervisor says running: a death this very moment (an agent's retry of a stream
            # that was just cut) is on record milliseconds later, in the runner's exit file; a first start is not.
            await asyncio.sleep(EXIT_RECORD_GRACE_S)
            mode, restarting, restart_in_s = self._restarting()
        if not hold_for_restart(lost_in_flight, retries, mode, restarting, self.retry_wait_s, first_loss_shared,
                                restart_in_s):
            return False
        log.info("the engine %s; holding the request for its restart (up to %.0fs)",
                 "died with it in flight" if lost_in_flight else "is restarting", self.retry_wait_s)
        deadline = time.monotonic() + (min(self.retry_wait_s, SECOND_RETRY_WAIT_S) if retries else self.retry_wait_s)
        while time.monotonic() < deadline:
            await asyncio.sleep(RESTART_POLL_S)
            if self._supervision()[0] in NO_RESTART_MODES:
                return False
            try:
                async with self._session().get(self.base + "/health", headers=self.engine_key.headers(),
                                               timeout=aiohttp.ClientTimeout(total=2)) as health:
                    if health.status == 200:
                        return True
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass
        log.warning("the engine was not back within %.0fs: the request goes to the fallback", self.retry_wait_s)
        return False

    def _restarting(self) -> tuple[str | None, bool, float | None]:
        """The supervisor's mode, whether a restart after a crash is under way
        (routing.engine_restarting), and the seconds until the restart its
        backoff waits for (None: not waiting one out)."""
        mode, crash_times, restart_at = self._supervision()
        ended = EngineExit.read(self.engine_exit_path)
        deaths = [t for t in (ended.ended if ended else None, self.engine_died_at) if t is not None]
        now = time.time()
        restart_in_s = max(0.0, restart_at - now) if mode == "backoff" and restart_at is not None else None
        return (mode, engine_restarting(mode, crash_times, max(deaths, default=None), now, self.retry_wait_s),
                restart_in_s)

    def _supervision(self) -> tuple[str | None, list[float], float | None]:
        """The supervisor's mode, recent crash times and when it restarts the
        engine (state/supervision.json), or (None, [], None)."""
        saved = SupervisionFile.read(self.supervision_path)
        if saved is None:
            return None, [], None
        times = saved.state.get("crash_times") or []
        due = saved.state.get("restart_at")
        return (saved.mode, [float(t) for t in times if isinstance(t, (int, float))],
                float(due) if isinstance(due, (int, float)) else None)

    async def _relay_stream(self, resp: aiohttp.ClientResponse, headers: list, to: ToEngine, send: Any,
                            path: str) -> None:
        """The engine's bytes as they arrive. A failure after the first byte
        is an SSE error event and no [DONE]. A client that goes away is
        gateway/hangup.py's: it cancels this, which closes the upstream and
        so stops the engine's generation."""
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        renamer = StreamRenamer(to.engine_name, to.public_name) if to.engine_name else None
        tail = b""
        try:
            async for data in resp.content.iter_any():
                await send({"type": "http.response.body", "body": renamer.feed(data) if renamer else data,
                            "more_body": True})
            tail = renamer.flush() if renamer else b""
        except (aiohttp.ClientError, OSError) as exc:
            self.engine_died_at = time.time()  # the agent's retry comes at once: routing.engine_restarting
            error = ApiError(503, MID_STREAM_FAILURE.format(type(exc).__name__), "engine_failed_mid_stream")
            tail = stream_failure(path, error)
        await send({"type": "http.response.body", "body": tail})
