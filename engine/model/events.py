"""What the worker tells a request's handler, and the channel it goes through.

The worker thread puts events; the handler, on the event loop, takes them in
batches. One channel per job, one writer (the worker), one reader (the
job's handler).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import EngineError

if TYPE_CHECKING:
    from .context_overflow import Truncation

FLUSH_S = 0.02  # once tokens flow, the handler collects them this often


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    truncation: "Truncation | None" = None  # what context_overflow = "truncate_middle" dropped of the prompt


@dataclass(frozen=True)
class Delta:
    text: str
    reasoning: bool = False  # the model's reasoning (`reasoning_content`), not its answer


@dataclass(frozen=True)
class ToolCalls:
    calls: list[dict]  # OpenAI-shaped tool calls


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache
    stop_sequence: str | None = None  # the request's stop string that ended the answer, if one did


@dataclass(frozen=True)
class Failed:
    error: EngineError


Event = Started | Delta | ToolCalls | Finished | Failed


class EventChannel:
    """Worker thread -> asyncio handler.

    Waking the event loop from the worker costs a GIL handoff that sits on
    the decode's critical path, a share of a small model's decode worth
    saving (docs/BENCHMARKS.md, "Why the engine is built as it is"). So once
    tokens flow, Deltas do not wake the loop: the handler collects them every
    FLUSH_S. Everything else (Started, the first Delta, tool calls, the end,
    errors) wakes it at once, so time to first token and the end of a stream
    are not delayed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Event] = deque()
        self._signalled = False
        self._streaming = False  # set by the handler once Deltas flow
        self._waiter: asyncio.Future | None = None

    def put(self, event: Event) -> None:  # worker thread
        self._items.append(event)
        if self._signalled or (self._streaming and type(event) is Delta):
            return
        self._signalled = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    @property
    def backlog(self) -> int:
        """Events not yet taken by the handler (a slow client's lag)."""
        return len(self._items)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, timeout: float) -> list[Event]:
        """All events available now, waiting up to `timeout` for the first."""
        deadline = self._loop.time() + timeout
        while True:
            self._signalled = False
            if self._items:
                out = [self._items.popleft() for _ in range(len(self._items))]
                if not self._streaming and any(type(e) is Delta for e in out):
                    self._streaming = True
                return out
            left = deadline - self._loop.time()
            if left <= 0:
                return []
            self._waiter = self._loop.create_future()
            timer = self._loop.call_later(min(left, FLUSH_S) if self._streaming else left, self._wake)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
