"""A Responses API request (engine/api/responses_api.py) as our
chat-completions request, and back (pure, no MLX): its input items as chat
messages, its fields as chat's, the errors of that chat request in the
Responses API's field names (`TranslationError`, the Messages API's too),
and an answer as the assistant message a later turn sends back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from mlxd.api_errors import INVALID_REQUEST

from .request_schema import ChatCompletionRequest, describe_validation_errors
from .responses_api import NamedFunction, ResponsesRequest
from .responses_items import (FunctionCallItem, FunctionCallOutputItem, InputImage, InputPart, ReasoningItem,
                              part_text)


def _content(parts: list[InputPart]) -> str | list[dict[str, Any]]:
    """Message content in chat's shape: a string, or parts where there are images."""
    if not any(isinstance(p, InputImage) for p in parts):
        return "".join(part_text(p) for p in parts)  # type: ignore[arg-type]
    return [{"type": "image_url", "image_url": {"url": p.image_url, **({"detail": p.detail} if p.detail in
                                                                        ("auto", "low", "high") else {})}}
            if isinstance(p, InputImage) else {"type": "text", "text": part_text(p)} for p in parts]


def input_messages(items: list[Any] | None) -> list[dict[str, Any]]:
    """A request's input as chat messages (pure): message items as they are,
    consecutive function_call items as one assistant message's tool_calls
    (joined to the assistant message just before them, the same answer's
    text), function_call_output items as tool messages, and reasoning items
    as the next assistant message's reasoning_content."""
    if items is None:
        return []
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        if reasoning:
            message["reasoning_content"] = "\n\n".join(reasoning)
            reasoning.clear()
        out.append(message)
        return message

    for item in items:
        if isinstance(item, ReasoningItem):
            if item.text():
                reasoning.append(item.text())
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
            else:
                assistant({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif item.role == "assistant":
            assistant({"role": "assistant", "content": _content(item.content)})
        else:
            out.append({"role": item.role, "content": _content(item.content)})
    return out


def chat_body(req: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The chat-completions request body for a Responses request (pure):
    `history` (the stored conversation before `previous_response_id`'s
    answer, which ends it) comes after the instructions and before the
    input, as OpenAI orders them; the instructions of earlier responses are
    not carried over."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) \
        + list(history) + input_messages(req.input)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [t.for_chat() for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    response_format = req.text.format.for_chat() if req.text and req.text.format else None
    if response_format is not None:
        body["response_format"] = response_format
    optional = {"max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "seed": req.seed, "reasoning_effort": req.reasoning.effort if req.reasoning else None}
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


# Chat fields -> the Responses fields they came from, for error messages.
_RESPONSES_PARAM = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                    "messages": "input", "reasoning_effort": "reasoning.effort"}


def to_chat_request(req: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> ChatCompletionRequest:
    """The chat request the engine serves for `req`; raises TranslationError
    (a 400's message, param and code, in the Responses API's field names)."""
    try:
        return ChatCompletionRequest.model_validate(chat_body(req, history))
    except ValidationError as exc:
        raise TranslationError(*describe_validation_errors(exc.errors())) from None
    except (RecursionError, ValueError, TypeError):
        raise TranslationError("the request could not be read", None, INVALID_REQUEST) from None


class TranslationError(ValueError):
    """A Responses (or Messages) request whose chat translation is refused
    (400); `renames`: chat's field names -> the request's (the Responses API's by default)."""

    def __init__(self, message: str, param: str | None, code: str, renames: dict[str, str] | None = None) -> None:
        head, dot, rest = (param or "").partition(".")
        renamed = (_RESPONSES_PARAM if renames is None else renames).get(head)
        if renamed is not None:
            where = renamed if head == "messages" else renamed + dot + rest
            message = message.replace(param or "", where, 1) if param else message
            param = where
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def assistant_message(text: str, reasoning: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """An answer as the chat assistant message a later turn sends back (what
    the store keeps for previous_response_id) (pure)."""
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["function"]["name"],
                                               "arguments": c["function"]["arguments"]}} for c in calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message
