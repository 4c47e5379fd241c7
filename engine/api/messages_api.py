"""Anthropic's Messages API (`POST /v1/messages`, what Claude Code speaks):
the request model and its translation into our chat-completions request
(pure, no MLX; shared with the gateway, which validates bodies with it before
routing, as it does with the chat and Responses models). The engine then
serves it as a chat job; its answer and stream are built by
engine/api/messages_builder.py, its errors have Anthropic's shape
(mlxd.api_errors.anthropic_error_body).

As Anthropic's own API: unknown fields are ignored (`metadata`,
`cache_control`, `citations`, `service_tier`...). Server tools and their
blocks never get here: engine/api/set_aside.py takes them out of the body
first. What this engine cannot honour (a PDF document, an image in a tool
result, a file id, more stop sequences than the engine matches) raises
`Unsupported`, a 400 with the code unsupported_parameter on which the gateway
sends the request on to LiteLLM's adapter and the Ollama fallback, as for chat.

The translation: `system` is the first system message (its text blocks kept
apart, so Claude Code's billing-header block is stripped whole:
engine/api/request_metadata.py); a user turn's tool_result blocks become tool
messages, in order, before a user message with the turn's text and images; an
assistant turn's tool_use blocks are its tool_calls and its thinking blocks
its reasoning_content; a system turn (Claude Code's mid-conversation
reminders) a system message; `thinking` is the chat request's own switch.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from mlxd.api_errors import INVALID_REQUEST

from .request_fields import MAX_STOP_SEQUENCES, MAX_TOKENS_SANITY, Lenient, ModelName, ThinkingControl, Unsupported
from .request_schema import ChatCompletionRequest, describe_validation_errors
from .responses_to_chat import TranslationError

# The structured-output name the chat request needs (Anthropic's formats have none).
OUTPUT_FORMAT_NAME = "output"


# --- content blocks -------------------------------------------------------------------

class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class Base64Source(Lenient):
    type: Literal["base64"]
    media_type: str = Field(min_length=1)
    data: str = Field(min_length=1)


class UrlSource(Lenient):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(Lenient):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]

    @field_validator("source", mode="before")
    @classmethod
    def _no_file_ids(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") == "file":
            raise Unsupported("images from Anthropic's Files API (a 'file' source) are not supported by the MLX "
                              "engine; send the image as base64")
        return v

    def url(self) -> str:
        """The image as chat's image_url reads it (engine/api/images.py decides which URLs it opens)."""
        s = self.source
        return f"data:{s.media_type};base64,{s.data}" if isinstance(s, Base64Source) else s.url


class DocumentBlock(Lenient):
    """A document: served when it is plain text (a `text` source, or a
    `content` source of text blocks), as that text; a PDF or a URL is beyond
    this engine."""
    type: Literal["document"]
    source: dict[str, Any]

    @field_validator("source")
    @classmethod
    def _plain_text(cls, v: dict[str, Any]) -> dict[str, Any]:
        kind = v.get("type")
        if kind == "text" and isinstance(v.get("data"), str):
            return v
        if kind == "content" and (isinstance(v.get("content"), str) or (
                isinstance(v.get("content"), list)
                and all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                        for b in v["content"]))):
            return v
        raise Unsupported(f"document blocks with a {str(kind)[:40]!r} source are not supported by the MLX engine "
                          "(plain-text documents only: a 'text' source, or 'content' of text blocks)")

    def text(self) -> str:
        s = self.source
        if s["type"] == "text":
            return s["data"]
        content = s["content"]
        return content if isinstance(content, str) else "".join(b["text"] for b in content)


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any] = {}


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list) and any(isinstance(b, dict) and b.get("type") in ("image", "document") for b in v):
            raise Unsupported("images and documents in a tool_result are not supported by the MLX engine (a tool "
                              "message is text)")
        return v

    def text(self) -> str:
        content = self.content
        text = content if isinstance(content, str) else "".join(b.text for b in content or [])
        # The model is told the tool failed (Anthropic's own rendering says so too).
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Lenient):
    """An earlier answer's reasoning, sent back: the assistant message's `reasoning_content`."""
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Lenient):
    """Reasoning Anthropic encrypted: opaque to any other model, dropped."""
    type: Literal["redacted_thinking"]
    data: str | None = None


Block = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                  | RedactedThinkingBlock, Field(discriminator="type")]
# The blocks each role's message may hold.
ALLOWED = {"user": (TextBlock, ImageBlock, DocumentBlock, ToolResultBlock),
           "assistant": (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock),
           "system": (TextBlock,)}


class Message(Lenient):
    """A turn; a `system` one is an operator's instruction mid-conversation
    (the mid-conversation-system beta Claude Code sends)."""
    role: Literal["user", "assistant", "system"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, v: Any) -> Any:
        """A string is one text block (as a union, str | list would report the string's error beside the blocks')."""
        return [{"type": "text", "text": v}] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _blocks_in_their_role(self) -> "Message":
        misplaced = next((b.type for b in self.content if not isinstance(b, ALLOWED[self.role])), None)
        if misplaced is not None:
            raise ValueError(f"{misplaced} blocks are not accepted in a {self.role} message")
        return self


# --- tools, formats, controls ----------------------------------------------------------

class Tool(Lenient):
    """A client tool (server tools were set aside before this model reads the body)."""
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1)
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs the tool's name")
        return self

    def for_chat(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"any": "required"}.get(self.type, self.type)


class OutputFormat(Lenient):
    """Structured output: `output_format` (the beta's field) or `output_config.format`."""
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")

    def for_chat(self) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": OUTPUT_FORMAT_NAME, "schema": self.json_schema}}


class OutputConfig(Lenient):
    format: OutputFormat | None = None


class MessagesRequest(Lenient):
    """POST /v1/messages."""

    model: ModelName
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_SANITY)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=100_000)
    stream: bool = False
    thinking: ThinkingControl | None = None
    output_format: OutputFormat | None = None
    output_config: OutputConfig | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            other = sorted({str(t.get("type"))[:60] for t in v if isinstance(t, dict) and t.get("type") not in
                            (None, "custom")})
            if other:
                raise Unsupported(f"the MLX engine serves client tools only, not the tool type(s) {', '.join(other)}")
        return v

    @field_validator("thinking", mode="before")
    @classmethod
    def _known_thinking(cls, v: Any) -> Any:
        """A thinking mode newer than ours is the model's default, not a 400 (Claude Code's change with its API's)."""
        if isinstance(v, dict) and v.get("type") not in ("enabled", "disabled", "adaptive"):
            return None
        return v

    @field_validator("stop_sequences")
    @classmethod
    def _few_stops(cls, v: list[str] | None) -> list[str] | None:
        if v and len(v) > MAX_STOP_SEQUENCES:
            raise Unsupported(f"the MLX engine matches at most {MAX_STOP_SEQUENCES} stop sequences")
        return v

    def response_format(self) -> dict[str, Any] | None:
        chosen = self.output_format or (self.output_config.format if self.output_config else None)
        return chosen.for_chat() if chosen is not None else None


# --- the translation -----------------------------------------------------------------------

def _parts(blocks: list[Any]) -> str | list[dict[str, Any]]:
    """A user message's text, images and documents in chat's shape: the
    text blocks kept apart, as chat parts (as LiteLLM's adapter sends them,
    so a turn renders the same on either route)."""
    parts = [{"type": "image_url", "image_url": {"url": b.url()}} if isinstance(b, ImageBlock)
             else {"type": "text", "text": b.text() if isinstance(b, DocumentBlock) else b.text} for b in blocks]
    return parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def user_messages(message: Message) -> list[dict[str, Any]]:
    """One user turn as chat messages (pure): its tool results as tool
    messages, in order, then its text and images as one user message."""
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                                 for b in message.content if isinstance(b, ToolResultBlock)]
    rest = [b for b in message.content if not isinstance(b, ToolResultBlock)]
    if rest or not out:
        out.append({"role": "user", "content": _parts(rest) if rest else ""})
    return out


def assistant_message(message: Message) -> dict[str, Any]:
    """One assistant turn as a chat message (pure): its text, its tool_use
    blocks as tool_calls, its thinking as reasoning_content."""
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if isinstance(b, ToolUseBlock)]
    out: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        out["tool_calls"] = calls
    reasoning = "\n\n".join(b.thinking for b in message.content if isinstance(b, ThinkingBlock) and b.thinking)
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def system_message(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": [{"type": "text", "text": b.text} for b in system]}]


def conversation(messages: list[Message]) -> list[dict[str, Any]]:
    """The turns as chat messages (pure). A system message mid-conversation
    stays a system message where it is, but after the next turn's tool
    results: a chat template wants those right after the calls they answer."""
    out: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []  # system messages waiting for the next turn
    for m in messages:
        if m.role == "system":
            held += system_message([b for b in m.content if isinstance(b, TextBlock)])
            continue
        turn = user_messages(m) if m.role == "user" else [assistant_message(m)]
        results = next((i for i, t in enumerate(turn) if t["role"] != "tool"), len(turn))
        out += turn[:results] + held + turn[results:]
        held = []
    return out + held


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat-completions request body for a Messages request (pure)."""
    messages = system_message(req.system) + conversation(req.messages)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "max_tokens": req.max_tokens}
    if req.tools:
        body["tools"] = [t.for_chat() for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice.for_chat()
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    response_format = req.response_format()
    if response_format is not None:
        body["response_format"] = response_format
    if req.thinking is not None:
        body["thinking"] = req.thinking.model_dump(exclude_none=True)
    optional = {"stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


# Chat fields -> the Messages fields they came from, for error messages.
MESSAGES_PARAM = {"response_format": "output_format", "stop": "stop_sequences"}


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request the engine serves for `req`; raises TranslationError
    (a 400's message, param and code, in the Messages API's field names)."""
    try:
        return ChatCompletionRequest.model_validate(chat_body(req))
    except ValidationError as exc:
        raise TranslationError(*describe_validation_errors(exc.errors()), renames=MESSAGES_PARAM) from None
    except (RecursionError, ValueError, TypeError):
        raise TranslationError("the request could not be read", None, INVALID_REQUEST) from None
