"""Anthropic's Messages API answers (`POST /v1/messages`): the whole message,
and the streamed events as Anthropic sends them, built from the worker's
events (engine/model/events.py) of the chat job a Messages request became
(engine/api/messages_api.py). The relay drives it like the chat builder
(engine/api/response_builder.py's `Presenter`).

Content blocks, in the order the answer gives them: a thinking block (the
model's reasoning), a text block, a tool_use block per tool call. A stream is

  message_start (the message, empty, with the prompt's tokens and what was dropped of it),
  per block: content_block_start, content_block_delta... (text_delta,
    thinking_delta, input_json_delta), content_block_stop,
  message_delta (stop_reason, stop_sequence, the whole usage), message_stop,

each an SSE event `event: <type>`; an engine failure mid-stream is an `error`
event in Anthropic's error shape, and the stream ends. Usage counts as
Anthropic's do: `input_tokens` are the prompt's tokens not read from the
prompt cache, `cache_read_input_tokens` those that were; and what
context_overflow = "truncate_middle" dropped is `dropped_input_tokens`, as on
the Responses API.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from mlxd.api_errors import anthropic_error_body

from ..model.errors import EngineError
from ..model.events import Started
from .messages_api import MessagesRequest
from .response_builder import Usage

# chat's finish_reason -> Anthropic's stop_reason ("stop" by a stop string is "stop_sequence")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    if stop_sequence is not None and finish_reason == "stop":
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason, "end_turn")


def usage_object(usage: Usage) -> dict[str, Any]:
    out = {"input_tokens": max(0, usage.prompt_tokens - usage.cached_tokens),
           "output_tokens": usage.completion_tokens,
           "cache_read_input_tokens": usage.cached_tokens,
           "cache_creation_input_tokens": 0}
    if usage.dropped_prompt_tokens:
        out["dropped_input_tokens"] = usage.dropped_prompt_tokens
    return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's `input` object ({} where they are not one)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_block(call: dict[str, Any], streamed: bool = False) -> dict[str, Any]:
    """A chat tool call as a tool_use block (its input sent as deltas when streamed)."""
    f = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": f["name"],
            "input": {} if streamed else tool_input(f["arguments"])}


def thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}  # no signature: nothing of Anthropic's to verify


def sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


class MessagesBuilder:
    """One message: its id, its model name, its job's start (the prompt's
    tokens for message_start), and (streamed) its blocks so far and the open one."""

    def __init__(self, req: MessagesRequest, started: Started | None = None, model: str | None = None) -> None:
        self.model = model or req.model
        self.started = started or Started(0)
        self.id = new_message_id()
        self._blocks = 0  # blocks started
        self._open: str | None = None  # the open block's kind: "text" or "thinking"

    def message(self, content: list[dict[str, Any]], reason: str | None, stop_sequence: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage}

    def full(self, text: str, finish_reason: str, usage: Usage, tool_calls: list[dict] | None = None,
             reasoning: str = "", stop_sequence: str | None = None) -> dict[str, Any]:
        """The whole (non-streamed) message."""
        content = [thinking_block(reasoning)] if reasoning else []
        if text.strip() or not tool_calls:  # the whitespace a model writes around its calls is no answer
            content.append({"type": "text", "text": text})
        content += [tool_use_block(call) for call in tool_calls or []]
        reason = stop_reason(finish_reason, stop_sequence)
        return self.message(content, reason, stop_sequence if reason == "stop_sequence" else None,
                            usage_object(usage))

    # --- the stream -------------------------------------------------------------------

    def opening(self) -> bytes:
        """message_start: what the cache held is known only at the end (message_delta's usage says it);
        what was dropped is said here too, where the SDK's accumulated message keeps it."""
        truncation = self.started.truncation
        usage = usage_object(Usage(self.started.prompt_tokens, 0, 0, truncation.dropped_tokens if truncation else 0))
        return sse("message_start", {"type": "message_start", "message": self.message([], None, None, usage)})

    def _start(self, block: dict[str, Any]) -> bytes:
        self._blocks += 1
        return sse("content_block_start", {"type": "content_block_start", "index": self._blocks - 1,
                                           "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})

    def _stop(self) -> bytes:
        return sse("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})

    def _close_open(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return self._stop()

    def delta(self, text: str, reasoning: bool = False) -> bytes:
        if not text:
            return b""
        kind = "thinking" if reasoning else "text"
        out = b""
        if self._open != kind:
            out += self._close_open()
            out += self._start(thinking_block("") if reasoning else {"type": "text", "text": ""})
            self._open = kind
        delta = {"type": "thinking_delta", "thinking": text} if reasoning else {"type": "text_delta", "text": text}
        return out + self._delta(delta)

    def tool_calls(self, calls: list[dict]) -> bytes:
        out = self._close_open()
        for call in calls:
            arguments = json.dumps(tool_input(call["function"]["arguments"]))  # as the whole message's input
            out += (self._start(tool_use_block(call, streamed=True))
                    + self._delta({"type": "input_json_delta", "partial_json": arguments}) + self._stop())
        return out

    def finished(self, finish_reason: str, usage: Usage, stop_sequence: str | None = None) -> bytes:
        out = self._close_open()
        if self._blocks == 0:  # an empty answer is still one (empty) text block, as the whole message has
            out += self._start({"type": "text", "text": ""}) + self._stop()
        reason = stop_reason(finish_reason, stop_sequence)
        delta = {"stop_reason": reason, "stop_sequence": stop_sequence if reason == "stop_sequence" else None}
        return (out + sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_object(usage)})
                + sse("message_stop", {"type": "message_stop"}))

    def failed(self, err: EngineError) -> bytes:
        """The engine failed mid-stream: Anthropic's `error` event (its SDK raises it), and nothing after."""
        return sse("error", anthropic_error_body(err.status, err.message, err.code, err.param))
