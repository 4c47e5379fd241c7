"""The Responses API's answers (`POST /v1/responses`): the whole response
object, and the streamed events in the order OpenAI sends them, built from
the worker's events (engine/model/events.py) of the chat job a Responses request
became (engine/api/responses_to_chat.py). The relay drives it like the chat
builder (engine/api/response_builder.py's `Presenter`).

Output items, in the order the answer gives them: a reasoning item (the
model's reasoning, as `reasoning_text` content), a message (its text, one
`output_text` part) and a function_call per tool call. A stream is

  response.created, response.in_progress,
  per item: response.output_item.added, then for text or reasoning
    response.content_part.added, response.{output_text|reasoning_text}.delta...,
    ...done, response.content_part.done; for a function call
    response.function_call_arguments.delta and .done; then response.output_item.done,
  response.completed (response.incomplete when max_output_tokens cut it),

each an SSE event `event: <type>` with a `sequence_number`; an engine failure
mid-stream is an `error` event and then `response.failed`, and the stream ends.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..model.errors import EngineError
from .response_builder import Usage
from .responses_api import ResponsesRequest
from .responses_to_chat import assistant_message

# Called with the finished response object and the answer as a chat assistant
# message, before the client has it (the store keeps both).
OnComplete = Callable[[dict[str, Any], dict[str, Any]], None]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


def usage_object(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            # cache_write_tokens: openai 3.x's types require it; nothing is billed as a cache write here.
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            **({"dropped_input_tokens": usage.dropped_prompt_tokens} if usage.dropped_prompt_tokens else {})}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status != "in_progress" else []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}


def function_call_item(item_id: str, call: dict[str, Any], status: str,
                       namespaces: dict[str, str] | None = None) -> dict[str, Any]:
    """A call as a function_call item; one of a `namespace` tool's functions names its namespace."""
    name = call["function"]["name"]
    item = {"type": "function_call", "id": item_id, "call_id": call["id"], "name": name,
            "arguments": call["function"]["arguments"] if status != "in_progress" else "", "status": status}
    if namespaces and name in namespaces:
        item["namespace"] = namespaces[name]
    return item


@dataclass
class _OpenItem:
    """The text or reasoning item that deltas are going to."""
    kind: str  # "message" or "reasoning"
    id: str
    index: int  # its output_index
    parts: list[str] = field(default_factory=list)


class ResponsesBuilder:
    """One response: its id, its `created_at`, the request's settings it
    echoes, and (streamed) the items given so far and the next sequence number."""

    def __init__(self, req: ResponsesRequest, model: str | None = None, on_complete: OnComplete | None = None) -> None:
        self.req = req
        self.model = model or req.model
        self.on_complete = on_complete
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # streamed: every item added, done or open
        self._open: _OpenItem | None = None
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[dict[str, Any]] = []
        # the functions that came in a `namespace` tool, and its name (their calls carry it back)
        self.namespaces = {t.name: t.namespace for t in req.tools or [] if t.namespace}

    # --- the response object --------------------------------------------------------

    def response(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text = {"format": r.text.format.echo() if r.text and r.text.format else {"type": "text"}}
        if r.text and r.text.verbosity:
            text["verbosity"] = r.text.verbosity
        tool_choice: Any = r.tool_choice.model_dump() if hasattr(r.tool_choice, "model_dump") else r.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None,
                          "summary": r.reasoning.summary if r.reasoning else None},
            "store": r.store, "temperature": 1.0 if r.temperature is None else r.temperature, "text": text,
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": r.truncation or "disabled",
            "usage": usage_object(usage) if usage is not None else None,
            "user": r.user, "metadata": r.metadata or {},
        }

    def _complete(self, status: str, output: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        body = self.response(status, output, usage)
        if self.on_complete is not None:
            self.on_complete(body, assistant_message("".join(self._text), "".join(self._reasoning), self._calls))
        return body

    @staticmethod
    def _status(finish_reason: str) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def full(self, text: str, finish_reason: str, usage: Usage, tool_calls: list[dict] | None = None,
             reasoning: str = "", stop_sequence: str | None = None) -> dict[str, Any]:
        """The whole (non-streamed) response object."""
        status = self._status(finish_reason)
        self._text, self._reasoning, self._calls = [text], [reasoning], list(tool_calls or [])
        output = []
        if reasoning:
            output.append(reasoning_item(new_id("rs"), reasoning, "completed"))
        if text:
            output.append(message_item(new_id("msg"), text, "completed"))
        output += [function_call_item(new_id("fc"), call, "completed", self.namespaces) for call in self._calls]
        if status == "incomplete" and output and output[-1]["type"] != "function_call":
            output[-1]["status"] = "incomplete"  # as a stream leaves its last text item
        return self._complete(status, output, usage)

    # --- the stream ------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def opening(self) -> bytes:
        started = self.response("in_progress", [])
        return self._event("response.created", response=started) + self._event("response.in_progress",
                                                                                response=started)

    def delta(self, text: str, reasoning: bool = False) -> bytes:
        if not text:
            return b""
        kind = "reasoning" if reasoning else "message"
        out = b""
        if self._open is None or self._open.kind != kind:
            out += self._close_open("completed")
            out += self._open_item(kind)
        item = self._open
        assert item is not None
        item.parts.append(text)
        (self._reasoning if reasoning else self._text).append(text)
        delta_type = "response.reasoning_text.delta" if reasoning else "response.output_text.delta"
        extra = {} if reasoning else {"logprobs": []}
        return out + self._event(delta_type, item_id=item.id, output_index=item.index, content_index=0, delta=text,
                                 **extra)

    def _open_item(self, kind: str) -> bytes:
        item = _OpenItem(kind, new_id("msg" if kind == "message" else "rs"), len(self._items))
        self._open = item
        added = (message_item if kind == "message" else reasoning_item)(item.id, "", "in_progress")
        self._items.append(added)
        part = text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
        return (self._event("response.output_item.added", output_index=item.index, item=added)
                + self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                              content_index=0, part=part))

    def _close_open(self, status: str) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        text = "".join(item.parts)
        common = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if item.kind == "message":
            done = message_item(item.id, text, status)
            out = self._event("response.output_text.done", **common, text=text, logprobs=[])
            part = text_part(text)
        else:
            done = reasoning_item(item.id, text, status)
            out = self._event("response.reasoning_text.done", **common, text=text)
            part = {"type": "reasoning_text", "text": text}
        self._items[item.index] = done
        return (out + self._event("response.content_part.done", **common, part=part)
                + self._event("response.output_item.done", output_index=item.index, item=done))

    def tool_calls(self, calls: list[dict]) -> bytes:
        out = self._close_open("completed")
        for call in calls:
            self._calls.append(call)
            index, item_id = len(self._items), new_id("fc")
            self._items.append(function_call_item(item_id, call, "in_progress", self.namespaces))
            arguments = call["function"]["arguments"]
            done = function_call_item(item_id, call, "completed", self.namespaces)
            out += (self._event("response.output_item.added", output_index=index, item=self._items[index])
                    + self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                  delta=arguments)
                    + self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                  arguments=arguments)
                    + self._event("response.output_item.done", output_index=index, item=done))
            self._items[index] = done
        return out

    def finished(self, finish_reason: str, usage: Usage, stop_sequence: str | None = None) -> bytes:
        status = self._status(finish_reason)
        out = self._close_open(status)
        body = self._complete(status, list(self._items), usage)
        return out + self._event("response.completed" if status == "completed" else "response.incomplete",
                                 response=body)

    def failed(self, err: EngineError) -> bytes:
        """The engine failed mid-stream: OpenAI's `error` event, then
        `response.failed` with the items given so far; nothing is stored."""
        if self._open is not None:
            item = self._open
            maker = message_item if item.kind == "message" else reasoning_item
            self._items[item.index] = maker(item.id, "".join(item.parts), "incomplete")
            self._open = None
        error = {"code": err.code, "message": err.message}
        return (self._event("error", code=err.code, message=err.message, param=err.param)
                + self._event("response.failed", response=self.response("failed", list(self._items), error=error)))
