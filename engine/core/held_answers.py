"""Answers whose end waits for their prompt on disk: one owner, `HeldAnswers`.

A request's prompt goes to disk once its first token is out (a checkpoint,
written behind by the prompt cache's writer: prompt_turns.py), so a crash
the moment its client has the answer still finds the prompt; a short answer
can end before that write lands. Its answer's end -- what the client sees
last, after which it may send the next turn or crash us -- is then held,
never waited for under a step: each step sends those whose write is on disk
(asked without waiting: PromptCache.written), whose client is gone, or that
waited CHECKPOINT_WAIT_S (a slow disk costs the disk tier, not the answer),
and the other rows decode meanwhile. With no row to decode and work about
to start (a long prefill or a load runs under one step), or when the engine
stops or fails, the answers held are waited for (each to its own limit) and
sent: one is never lost. The request itself was let go when it ended (its
memory, its place in the table and the queue): only its last event waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..model.decoder_rows import Ended

# The most an answer's end waits for its prompt's write: short answers after long prompts are the ones that wait.
CHECKPOINT_WAIT_S = 1.0
POLL_S = 0.01  # the longest a step waits on an empty queue while an end is held (engine_core.WAIT_S otherwise)


@dataclass(frozen=True)
class Held:
    """An answer's end, held: the request ended (its KV let go), and its prompt's write."""

    ended: Ended
    writing: Any  # the prompt cache's write of its prompt (PromptCache.checkpoint)
    deadline: float  # monotonic: sent by then, written or not


def must_hold(writing: Any, finish: str, cancelled: bool, written: Callable[[Any], bool]) -> bool:
    """Whether an answer's end waits (pure but for `written`): its prompt's
    write is under way, and a client is there to see a complete answer."""
    return writing is not None and finish != "cancelled" and not cancelled and not written(writing)


def due(h: Held, now: float, written: Callable[[Any], bool]) -> bool:
    """Whether a held answer's end goes out now (pure but for `written`)."""
    return now >= h.deadline or h.ended.admitted.job.cancelled.is_set() or written(h.writing)


class HeldAnswers:
    """The answers' ends waiting for their prompt on disk (worker thread only).
    `cache()`: the prompt cache (the core's, replaced with it), asked
    whether a write is done (`written`) or waited for (`await_write`);
    `send(ended)`: the answer's end, to its client (the runner's finish)."""

    def __init__(self, cache: Callable[[], Any], send: Callable[[Ended], None]) -> None:
        self._cache = cache
        self._send = send
        self._held: list[Held] = []  # oldest first

    def __len__(self) -> int:
        return len(self._held)

    def _written(self, writing: Any) -> bool:
        return self._cache().written(writing)

    def step(self, wait: bool) -> None:
        """Each step, while any is held: those due sent (`wait`: all of them,
        waited for -- no row decodes, and work that may be long is to start)."""
        if wait:
            self.send_all()
        else:
            self.send_due()

    def end(self, e: Ended, writing: Any, now: float | None = None) -> bool:
        """A request's answer ended: its end to its client now, or held until
        its prompt's write is on disk. True where it is held."""
        a = e.admitted
        if not must_hold(writing, e.finish, a.job.cancelled.is_set(), self._written):
            self._send(e)
            return False
        now = time.monotonic() if now is None else now
        self._held.append(Held(replace(e, kv=None), writing, now + CHECKPOINT_WAIT_S))  # its KV went to the cache
        return True

    def send_due(self, now: float | None = None) -> None:
        """Each step: the ends whose write landed (or whose time is up, or whose client left), sent."""
        now = time.monotonic() if now is None else now
        for h in [h for h in self._held if due(h, now, self._written)]:
            self._held.remove(h)
            self._send(h.ended)

    def send_all(self) -> None:
        """Every end held, each once its write is on disk or its time is up
        (waited for: nothing decodes meanwhile), oldest first."""
        while self._held:
            h = self._held.pop(0)
            left = h.deadline - time.monotonic()
            if left > 0 and not h.ended.admitted.job.cancelled.is_set():
                self._cache().await_write(h.writing, left)
            self._send(h.ended)
