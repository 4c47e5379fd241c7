"""A request as the worker serves it (a job): what to generate, with which
sampling settings, and where the events go. The HTTP side builds it
(engine/api/request_job.py); the core schedules it and the model floor
generates its answer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from .events import EventChannel
from .grammar import OutputRules


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


@dataclass(eq=False)
class Job:
    id: str
    kind: str  # "chat" or "completion"
    model_id: str
    params: SamplingParams
    channel: EventChannel
    deadline_s: float
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra chat-template arguments
    keep_alive_s: float | None = None  # the model's idle time after it (engine/core/keep_alive.py); None: the engine's
    images: tuple[bytes, ...] = ()  # encoded, in the order of the messages' image parts
    conversation: tuple[str, ...] = ()  # agent-safe cache keys (engine/cache/cache_keys.py); () when off
    rules: OutputRules = OutputRules()  # how the answer is bound: a JSON schema, a forced tool (engine/model/grammar.py)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Decoded alone, never batched: it was in flight at a crash with others (a suspect, engine/api/quarantine.py).
    alone: bool = False
    # Over the model's context: "error" (400) or "truncate_middle" (engine/model/context_overflow.py).
    context_overflow: str = "error"

    @property
    def text(self) -> str:
        """The request's text, for fault matching."""
        if self.messages is not None:
            return "\n".join(str(m.get("content", "")) for m in self.messages)
        return self.prompt if isinstance(self.prompt, str) else ""

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the request's content (for the crash journal)."""
        body = json.dumps([self.model_id, self.messages, self.tools, self.prompt, self.template_kwargs,
                           [digest(image) for image in self.images]]
                          + ([repr(self.rules)] if self.rules != OutputRules() else []), sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:16]


def digest(data: bytes) -> str:
    """An image's identity in a fingerprint."""
    return hashlib.sha256(data).hexdigest()[:16]
