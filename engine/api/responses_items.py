"""The Responses API's input items (pydantic; pure, no MLX): messages and
their parts, the function calls and outputs of earlier turns, and earlier
answers' reasoning, as `ResponsesRequest.input` (engine/api/responses_api.py)
holds them; engine/api/responses_to_chat.py turns them into chat messages.
What this engine cannot read (hosted tools' items, item references, files,
audio) raises `Unsupported`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from .request_fields import Lenient, Unsupported

# Input items this engine turns into chat messages; any other item type is a
# hosted tool's call or output (web_search_call, computer_call_output...) or a
# reference to OpenAI's own storage (item_reference): Unsupported.
INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


class InputText(Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(Lenient):
    """An earlier answer's refusal, sent back: read as its text."""
    type: Literal["refusal"]
    refusal: str


class InputImage(Lenient):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None

    @model_validator(mode="after")
    def _url_only(self) -> "InputImage":
        if self.file_id:
            raise Unsupported("input_image.file_id: uploaded files are not supported by the MLX engine; send the "
                              "image as image_url (a data URL)")
        if not self.image_url:
            raise ValueError("input_image needs image_url")
        return self


def _as_parts(parts: Any) -> Any:
    """Content as parts (a string is one text part: as a union, str | list
    would report the string's error beside the parts' own), refusing the
    kinds of part this engine cannot read."""
    if isinstance(parts, str):
        return [{"type": "input_text", "text": parts}]
    if isinstance(parts, list):
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_file", "input_audio"):
                raise Unsupported(f"{kind} content is not supported by the MLX engine (text and input_image only)")
    return parts


InputPart = Annotated[InputText | RefusalPart | InputImage, Field(discriminator="type")]


def part_text(part: InputText | RefusalPart) -> str:
    return part.refusal if isinstance(part, RefusalPart) else part.text


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputPart]

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        return _as_parts(v)


class FunctionCallItem(Lenient):
    """A function call of an earlier answer, sent back."""
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1, max_length=256)
    arguments: str = "{}"


class FunctionCallOutputItem(Lenient):
    """What the client's function returned."""
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[InputPart]

    @field_validator("output", mode="before")
    @classmethod
    def _text_output(cls, v: Any) -> Any:
        v = _as_parts(v)
        if isinstance(v, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in v):
            raise Unsupported("images in a function_call_output are not supported by the MLX engine")
        return v

    def text(self) -> str:
        return "".join(part_text(p) for p in self.output if not isinstance(p, InputImage))


class SummaryText(Lenient):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningText(Lenient):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(Lenient):
    """An earlier answer's reasoning, sent back: its text becomes the next
    assistant message's `reasoning_content` (encrypted content is opaque to us)."""
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        if self.content:
            return "".join(c.text for c in self.content)
        return "\n\n".join(s.text for s in self.summary)


def _item_tag(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return kind if kind in INPUT_ITEMS else "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_tag)]
