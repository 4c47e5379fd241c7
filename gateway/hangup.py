"""A client that hangs up stops its request, upstream too.

LiteLLM reads the client's side of an exchange only when it streams, and
the fast path only once the engine's first byte is there. Before that, a
client that went away (an agent stopped, a timeout) left its request
running: the engine went on prefilling a long prompt nobody would read,
busy for every other client. `HangUpWatch` wraps the app below KeyGuard:
for a POST it reads the body, hands it to the app (`ClientLink`, the app's
`receive`), and keeps reading the client's side itself; when the client
disconnects before the answer is complete it cancels the app's task. The
cancelled upstream request closes its connection to the engine, which
cancels the job there (engine/api/relay.py), and the engine's prefill stops
between two steps (engine/model/prefill.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


class ClientLink:
    """The app's `receive` for one request: the body already read, then
    (only) the client's disconnect, once `watch` has seen it."""

    def __init__(self, body: bytes, receive: Any) -> None:
        self._body: bytes | None = body
        self._receive = receive
        self.gone = asyncio.Event()

    async def __call__(self) -> dict:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def watch(self) -> None:
        """The client's side, read to its end: the disconnect."""
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone.set()


async def read_body(receive: Any) -> bytes | None:
    """The whole request body; None when the client went away first."""
    parts, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


class Replay:
    """`receive` for LiteLLM: the body already read, then the real channel
    (which can only say the client went away)."""

    def __init__(self, body: bytes, receive: Any) -> None:
        self.body: bytes | None = body
        self.receive = receive

    async def __call__(self) -> dict:
        if self.body is None:
            return await self.receive()
        body, self.body = self.body, None
        return {"type": "http.request", "body": body, "more_body": False}


class HangUpWatch:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return
        link = ClientLink(body, receive)
        answered = False  # the answer's last byte went out: a disconnect after it is the connection's end

        async def tracked_send(message: dict) -> None:
            nonlocal answered
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True

        task = asyncio.ensure_future(self.app(scope, link, tracked_send))
        watcher = asyncio.ensure_future(link.watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not answered:  # the client hung up first: nobody reads the answer
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                return
            await task
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
