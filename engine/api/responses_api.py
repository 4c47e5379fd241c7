"""OpenAI's Responses API (`POST /v1/responses`): the request model and its
translation into our chat-completions request (pure, no MLX; shared with
the gateway, which validates bodies with it before routing, as it does with
engine/api/request_schema.py's). The engine then serves it as a chat job; its
answer is built by engine/api/responses_builder.py and kept, for
`previous_response_id`, by engine/api/responses_store.py.

As for chat: unknown fields are ignored; what we accept is honoured; what we
cannot honour (hosted tools, background mode, prompt templates, stored
conversations, logprobs, files, item references) raises `Unsupported`, a 400
with the code unsupported_parameter naming it. Unlike chat's, the gateway
refuses these too rather than fall back: LiteLLM's Responses bridge to
Ollama would drop them without a word (gateway/routing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from mlxd.api_errors import INVALID_REQUEST

from .request_schema import (MAX_TOKENS_SANITY, ChatCompletionRequest, Lenient, ModelName, ReasoningEffort, Unsupported,
                             describe_validation_errors)

FUNCTION_TOOL = "function"
# Input items this engine turns into chat messages; any other item type is a
# hosted tool's call or output (web_search_call, computer_call_output...) or a
# reference to OpenAI's own storage (item_reference): Unsupported.
INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


# --- input items ---------------------------------------------------------------

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


def _part_text(part: InputText | RefusalPart) -> str:
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
        return "".join(_part_text(p) for p in self.output if not isinstance(p, InputImage))


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


# --- tools, formats, controls ----------------------------------------------------

NAMESPACE_TOOL = "namespace"


def flattened_namespaces(tools: list[Any]) -> list[Any]:
    """`namespace` tools (a named group of function tools, as Codex CLI sends
    its sub-agent tools) as their function tools, each naming its namespace,
    which the answer's function_call items carry back (pure). Anything else
    stays as it is."""
    out: list[Any] = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == NAMESPACE_TOOL and isinstance(tool.get("tools"), list):
            out += [{**inner, "namespace": str(tool.get("name") or "")} if isinstance(inner, dict) else inner
                    for inner in tool["tools"]]
        else:
            out.append(tool)
    return out


class FunctionTool(Lenient):
    """A function tool in the Responses API's flat shape."""
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    namespace: str | None = None  # the `namespace` tool it came in (flattened): its calls name it back

    def for_chat(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type", "namespace"}, exclude_none=True)}


class NamedFunction(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and (not self.name or self.json_schema is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self

    def for_chat(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema":
            spec: dict[str, Any] = {"name": self.name, "schema": self.json_schema}
            if self.description is not None:
                spec["description"] = self.description
            if self.strict is not None:
                spec["strict"] = self.strict
            return {"type": "json_schema", "json_schema": spec}
        return None

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Lenient):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Lenient):
    """POST /v1/responses."""

    model: ModelName
    input: list[InputItem] | None = None  # a string is read as one user message
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_SANITY)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=4096)  # LiteLLM's are long
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    # What this engine cannot honour: refused with unsupported_parameter.
    background: bool | None = None
    n: int | None = None
    top_logprobs: int | None = None
    prompt: Any = None
    conversation: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "message", "role": "user", "content": v}]
        if isinstance(v, list):
            for i, item in enumerate(v):
                kind = item.get("type") if isinstance(item, dict) else None
                if kind is not None and kind not in INPUT_ITEMS:
                    raise Unsupported(f"input[{i}]: items of type {str(kind)[:60]!r} are not supported by the MLX "
                                      f"engine (only {', '.join(INPUT_ITEMS)})")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = flattened_namespaces(v)
            other = sorted({str(t.get("type"))[:60] for t in v if isinstance(t, dict) and t.get("type") != FUNCTION_TOOL})
            if other:
                raise Unsupported(f"the MLX engine serves function tools only, not the tool type(s) {', '.join(other)}")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != FUNCTION_TOOL:
            raise Unsupported(f"tool_choice of type {str(v.get('type'))[:60]!r} is not supported by the MLX engine "
                              "(none, auto, required or a function)")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise Unsupported("background responses are not supported by the MLX engine")
        return v

    @field_validator("n")
    @classmethod
    def _single(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise Unsupported("only n=1 is supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise Unsupported("logprobs are not supported by this engine")
        return v

    @field_validator("prompt")
    @classmethod
    def _no_prompt_template(cls, v: Any) -> Any:
        if v is not None:
            raise Unsupported("prompt templates are not supported by the MLX engine; send input and instructions")
        return v

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, v: Any) -> Any:
        if v is not None:
            raise Unsupported("conversations are not supported by the MLX engine; use previous_response_id")
        return v

    @field_validator("include")
    @classmethod
    def _no_logprobs_included(cls, v: list[str] | None) -> list[str] | None:
        if v and LOGPROBS_INCLUDE in v:
            raise Unsupported("logprobs are not supported by this engine")
        return v

    @model_validator(mode="after")
    def _something_to_answer(self) -> "ResponsesRequest":
        if self.input is None and self.previous_response_id is None:
            raise ValueError("input is required (unless previous_response_id is given)")
        return self


# --- the translation ---------------------------------------------------------------

def _content(parts: list[InputPart]) -> str | list[dict[str, Any]]:
    """Message content in chat's shape: a string, or parts where there are images."""
    if not any(isinstance(p, InputImage) for p in parts):
        return "".join(_part_text(p) for p in parts)  # type: ignore[arg-type]
    return [{"type": "image_url", "image_url": {"url": p.image_url, **({"detail": p.detail} if p.detail in
                                                                        ("auto", "low", "high") else {})}}
            if isinstance(p, InputImage) else {"type": "text", "text": _part_text(p)} for p in parts]


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
