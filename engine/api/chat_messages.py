"""A chat request's messages (pydantic): their text and image parts, the
tool calls an earlier answer made, the tools a request offers, and each
message as chat templates take it (no MLX).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from .request_fields import Lenient, clean_text


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ImageUrl(Lenient):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Lenient):
    """An image for a vision model (engine/api/images.py reads its URL)."""
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"]  # required, as in OpenAI's API (LiteLLM's Ollama path reads it)
    function: FunctionCall


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Lenient):
    """OpenAI's tool shape; anything else would reach the chat template (or
    LiteLLM's Ollama provider, which answers 500) unchecked."""
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(Lenient):
    class _Name(Lenient):
        name: str = Field(min_length=1)

    type: Literal["function"]
    function: _Name


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning, sent back

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role != "user" and self.image_urls():
            raise ValueError(f"images are accepted in user messages only, not in a {self.role} message")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return clean_text("".join(part.text for part in self.content if isinstance(part, TextPart)))
        return clean_text(self.content or "")

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def template_content(self) -> str | list[dict[str, str]]:
        """The text, or, where the message has images, its parts in order
        with each image as {"type": "image"} (the form chat templates and
        mlx-vlm count images by)."""
        if not self.image_urls():
            return self.text()
        return [{"type": "text", "text": clean_text(part.text)} if isinstance(part, TextPart) else {"type": "image"}
                for part in self.content]  # type: ignore[union-attr]

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it (tool-call arguments as dicts,
        the 'developer' role as 'system')."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.template_content()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_template_tool_call(tc) for tc in self.tool_calls]
        if self.reasoning_content:  # templates that keep reasoning render it (Qwen3's)
            out["reasoning_content"] = clean_text(self.reasoning_content)
        return out


def _template_tool_call(tc: ToolCall) -> dict[str, Any]:
    args = tc.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the raw string; templates render it as given
    return {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": args}}
