"""The field types and validators the OpenAI request models share
(engine/api/request_schema.py's, and the Responses and Messages APIs'):
the bounds, the model name and keep_alive, `Unsupported` (an engine limit,
answered with unsupported_parameter), lenient models that ignore unknown
fields, the response format, and the reasoning controls (pure, no MLX).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from mlxd.durations import parse_duration

from ..model.grammar import ANY_OBJECT, schema_problem

# A generous bound on max_tokens: values up to it are clamped to the engine's
# cap; beyond it the request is nonsense and gets a 400.
MAX_TOKENS_SANITY = 1_000_000
MAX_STOP_SEQUENCES = 4

ModelName = Annotated[str, StringConstraints(min_length=1, max_length=256)]


def _a_duration(v: str | int | float | None) -> str | int | float | None:
    if v is not None:
        parse_duration(v)  # its ValueError names what a duration looks like
    return v


KeepAlive = Annotated[str | int | float | None, AfterValidator(_a_duration)]


class Unsupported(ValueError):
    """A valid request this engine cannot honour (n > 1, logprobs...), as
    opposed to a malformed one: its type, not its wording, makes the 400's
    code unsupported_parameter, on which the gateway falls back to Ollama."""


def clean_text(text: str) -> str:
    """Replace lone surrogates (valid JSON, invalid Unicode) with U+FFFD so
    tokenizers never see them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")



class StreamOptions(Lenient):
    include_usage: bool = False


class JsonSchemaFormat(Lenient):
    name: str = Field(default="response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: dict(ANY_OBJECT), alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _enforceable(cls, v: dict[str, Any]) -> dict[str, Any]:
        problem = schema_problem(v)
        if problem:
            raise Unsupported(f"the MLX engine cannot enforce this JSON schema: {problem}")
        return v


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must match; None for free text."""
        if self.type == "json_object":
            return dict(ANY_OBJECT)
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_
        return None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ReasoningControl(Lenient):
    """`reasoning: {...}` (OpenRouter's and the Responses API's shape)."""

    effort: ReasoningEffort | None = None
    enabled: bool | None = None


class ThinkingControl(Lenient):
    """`thinking: {...}` (Anthropic's shape)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


def thinking_switch(template_kwargs: dict[str, Any] | None, enable_thinking: bool | None,
                    thinking: ThinkingControl | None, reasoning: ReasoningControl | None,
                    reasoning_effort: str | None) -> bool | None:
    """Whether the client asked for reasoning on (True), off (False) or said
    nothing (None: the model's own default), from whichever of the controls
    clients send; the most specific one wins (pure)."""
    if template_kwargs and isinstance(template_kwargs.get("enable_thinking"), bool):
        return template_kwargs["enable_thinking"]
    if enable_thinking is not None:
        return enable_thinking
    if thinking is not None:
        return thinking.type != "disabled"
    if reasoning is not None:
        if reasoning.enabled is not None:
            return reasoning.enabled
        if reasoning.effort is not None:
            return reasoning.effort != "none"
    if reasoning_effort is not None:
        return reasoning_effort != "none"
    return None
