"""The engine's answers in the OpenAI wire format: whole response bodies and
SSE chunks (chat or text completion), and the usage they report. The
requests they answer are engine/api/request_schema.py's. `Presenter` is what the
relay drives, one per request: `ChatPresenter` over `ResponseBuilder` here,
engine/api/responses_builder.py's for the Responses API, engine/api/messages_builder.py's
for Anthropic's Messages API."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from ..model.errors import EngineError


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    dropped_prompt_tokens: int = 0  # the conversation's tokens context_overflow = "truncate_middle" dropped

    def as_dict(self) -> dict[str, Any]:
        out = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.dropped_prompt_tokens:
            out["dropped_prompt_tokens"] = self.dropped_prompt_tokens
        return out


class ResponseBuilder:
    """Builds response bodies and SSE chunks for one request (one id, one
    `created`, one model name), in chat or text-completion shape."""

    def __init__(self, kind: Literal["chat", "completion"], model: str, fingerprint: str) -> None:
        self.kind = kind
        self.model = model
        self.fingerprint = fingerprint
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        # The constant head of every chunk, serialised once (per-token cost matters).
        head = {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}
        self._chunk_head = json.dumps(head)[:-1]

    def full(self, text: str, finish_reason: str, usage: Usage, tool_calls: list[dict] | None = None,
             reasoning: str = "", stop_sequence: str | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            # the whitespace a model writes between or after its calls is no answer
            message: dict[str, Any] = {"role": "assistant",
                                       "content": text if text.strip() or not tool_calls else None}
            if reasoning:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [choice], "usage": usage.as_dict()}

    def _sse(self, choices: str, usage: str = "") -> bytes:
        return f'data: {self._chunk_head}, "choices": {choices}{usage}}}\n\n'.encode()

    def role_chunk(self) -> bytes:
        if self.kind != "chat":
            return b""
        return self._sse('[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]')

    def delta_chunk(self, text: str, reasoning: bool = False) -> bytes:
        t = json.dumps(text)
        if self.kind == "chat":
            key = "reasoning_content" if reasoning else "content"
            return self._sse(f'[{{"index": 0, "delta": {{"{key}": {t}}}, "finish_reason": null}}]')
        return self._sse(f'[{{"index": 0, "text": {t}, "finish_reason": null}}]')

    def tool_calls_chunk(self, calls: list[dict], first_index: int) -> bytes:
        indexed = [{"index": first_index + i, **c} for i, c in enumerate(calls)]
        return self._sse(f'[{{"index": 0, "delta": {{"tool_calls": {json.dumps(indexed)}}}, "finish_reason": null}}]')

    def finish_chunk(self, finish_reason: str) -> bytes:
        r = json.dumps(finish_reason)
        if self.kind == "chat":
            return self._sse(f'[{{"index": 0, "delta": {{}}, "finish_reason": {r}}}]')
        return self._sse(f'[{{"index": 0, "text": "", "finish_reason": {r}}}]')

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._sse("[]", f', "usage": {json.dumps(usage.as_dict())}')


class Presenter(Protocol):
    """One request's answer in a route's shape, as the relay produces it: a
    whole body, or a stream's bytes event by event."""

    # stop_sequence: the request's stop string that ended the answer (Anthropic's answers name it)
    def full(self, text: str, finish_reason: str, usage: Usage, tool_calls: list[dict] | None = None,
             reasoning: str = "", stop_sequence: str | None = None) -> dict[str, Any]: ...

    def opening(self) -> bytes: ...  # a stream's first bytes, sent with the first output

    def delta(self, text: str, reasoning: bool = False) -> bytes: ...

    def tool_calls(self, calls: list[dict]) -> bytes: ...

    def finished(self, finish_reason: str, usage: Usage,
                 stop_sequence: str | None = None) -> bytes: ...  # the stream's last bytes

    def failed(self, err: EngineError) -> bytes: ...  # the stream's last bytes: never a silent truncation


class ChatPresenter:
    """/v1/chat/completions and /v1/completions: ResponseBuilder's bodies
    and chunks; the stream ends with the usage chunk (if asked for) and [DONE]."""

    def __init__(self, builder: ResponseBuilder, include_usage: bool) -> None:
        self.builder = builder
        self.include_usage = include_usage
        self.calls_sent = 0
        self.full = builder.full

    def opening(self) -> bytes:
        return self.builder.role_chunk()

    def delta(self, text: str, reasoning: bool = False) -> bytes:
        return self.builder.delta_chunk(text, reasoning)

    def tool_calls(self, calls: list[dict]) -> bytes:
        chunk = self.builder.tool_calls_chunk(calls, self.calls_sent)
        self.calls_sent += len(calls)
        return chunk

    def finished(self, finish_reason: str, usage: Usage, stop_sequence: str | None = None) -> bytes:
        out = self.builder.finish_chunk(finish_reason)
        if self.include_usage:
            out += self.builder.usage_chunk(usage)
        return out + SSE_DONE

    def failed(self, err: EngineError) -> bytes:
        return sse_error(err.body())


def sse_error(body: dict[str, Any]) -> bytes:
    """An error event inside a stream (the stream then ends without [DONE])."""
    return f"data: {json.dumps(body)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
