"""OpenAI's Responses API (`POST /v1/responses`): the request model (pure,
no MLX; shared with the gateway, which validates bodies with it before
routing, as it does with engine/api/request_schema.py's). The engine then serves it as a chat job; its
answer is built by engine/api/responses_builder.py and kept, for
`previous_response_id`, by engine/api/responses_store.py.

As for chat: unknown fields are ignored; what we accept is honoured; what we
cannot honour (hosted tools, background mode, prompt templates, stored
conversations, logprobs, files, item references) raises `Unsupported`, a 400
with the code unsupported_parameter naming it. Unlike chat's, the gateway
refuses these too rather than fall back: LiteLLM's Responses bridge to
Ollama would drop them without a word (gateway/routing.py).

Here: the request and its tools, formats and controls; its input items are
engine/api/responses_items.py's, its translation into a chat request
engine/api/responses_to_chat.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .request_fields import MAX_TOKENS_SANITY, Lenient, ModelName, ReasoningEffort, Unsupported
from .responses_items import INPUT_ITEMS, InputItem

FUNCTION_TOOL = "function"
LOGPROBS_INCLUDE = "message.output_text.logprobs"


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
