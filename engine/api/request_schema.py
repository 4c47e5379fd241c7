"""The OpenAI request contract: the request models (validated by pydantic),
shared with the gateway, which checks bodies with them before routing (no
MLX here). The answers are built by engine/api/response_builder.py.

Unknown request fields are ignored, as OpenAI-compatible servers do, so that
clients sending `user`, `metadata`... keep working. Everything we accept is
honoured (`response_format` and `tool_choice` are enforced by a grammar,
engine/model/grammar.py); what we cannot honour (n > 1, logprobs, a JSON schema
feature the grammar engine cannot enforce) raises `Unsupported`, which becomes
a 400 with the code unsupported_parameter, naming the field, so the gateway
can fall back to Ollama.

Here: the requests of /v1/chat/completions, /v1/completions and
/v1/embeddings, and how their validation errors read. The field types and
validators they share (and the Responses and Messages APIs with them) are
engine/api/request_fields.py's; a chat request's messages,
engine/api/chat_messages.py's.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from mlxd.api_errors import INVALID_REQUEST, UNSUPPORTED_PARAMETER

from ..model.grammar import ANY_OBJECT, OutputRules, ToolSpec, schema_problem
from .chat_messages import ChatMessage, ImagePart, NamedToolChoice, ToolDefinition
from .request_fields import (MAX_STOP_SEQUENCES, MAX_TOKENS_SANITY, KeepAlive, Lenient, ModelName, ReasoningControl,
                             ReasoningEffort, ResponseFormat, StreamOptions, ThinkingControl, Unsupported, clean_text,
                             thinking_switch)


class SamplingFields(Lenient):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: ModelName
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_SANITY)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=100_000)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    n: int = Field(default=1, ge=1, le=128)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    logprobs: bool | int | None = None
    # Ollama's: how long the model stays loaded after this request ("5m", 0: unload now, -1: never; mlxd.durations).
    keep_alive: KeepAlive = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop sequences must be 1 to 256 characters")
        return stops

    @field_validator("n")
    @classmethod
    def _single_choice(cls, v: int) -> int:
        if v != 1:
            raise Unsupported("only n=1 is supported (the engine generates one sequence at a time)")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v:
            raise Unsupported("logprobs are not supported by this engine")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit() or len(key) > 9:
                raise ValueError(f"logit_bias keys must be token ids, got {key[:40]!r}")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


# Template arguments a client may not set through chat_template_kwargs: the
# engine passes them itself.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                    "tokenize", "continue_final_message", "return_dict", "chat_template"})


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_SANITY)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Reasoning controls, mapped to the chat template's switch where the model has
    # one (mlx-lm renames `enable_thinking` to the model's own argument) and
    # harmless where it has none.
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    thinking: ThinkingControl | None = None
    reasoning: ReasoningControl | None = None
    reasoning_effort: ReasoningEffort | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(RESERVED_TEMPLATE_ARGS & set(v or {}))
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")
        return v

    def template_kwargs(self) -> dict[str, Any]:
        """Extra arguments for the chat template: the client's own, and the
        reasoning switch when any control set it."""
        out = dict(self.chat_template_kwargs or {})
        switch = thinking_switch(self.chat_template_kwargs, self.enable_thinking, self.thinking, self.reasoning,
                                 self.reasoning_effort)
        if switch is not None:
            out["enable_thinking"] = switch
        return out

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                             f"request's tools ({', '.join(names) or 'none given'})")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one tool in `tools`")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        # with a response schema the answer may be a call to any tool instead: every tool's schema is bound then
        bound_calls = choice != "none" and self.response_format is not None and self.response_format.schema() is not None
        for i, tool in enumerate(self.tools or []):
            f = tool.function
            if (forced and (not isinstance(choice, NamedToolChoice) or choice.function.name == f.name)) or f.strict \
                    or bound_calls:
                problem = schema_problem(f.parameters or dict(ANY_OBJECT))
                if problem:
                    raise Unsupported(f"tools[{i}].function.parameters: the MLX engine cannot enforce this tool's "
                                      f"schema: {problem}")
        return self

    def output_rules(self) -> OutputRules:
        """How the answer is bound (engine/model/grammar.py): the response format's
        schema and the tool choice."""
        choice = self.tool_choice
        return OutputRules(
            schema=self.response_format.schema() if self.response_format else None,
            tool_choice=choice.function.name if isinstance(choice, NamedToolChoice) else (choice or "auto"),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            tools=tuple(ToolSpec(t.function.name, t.function.parameters or dict(ANY_OBJECT), bool(t.function.strict))
                        for t in self.tools or []))

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def image_parts(self) -> list[tuple[str, str]]:
        """(where, url) of every image part, in the messages' order."""
        return [(f"messages[{i}].content[{j}]", part.image_url.url)
                for i, m in enumerate(self.messages) if isinstance(m.content, list)
                for j, part in enumerate(m.content) if isinstance(part, ImagePart)]

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:  # not Unsupported: Ollama takes one prompt too, so no fallback
                raise ValueError("only one prompt per request is supported")
            return clean_text(v[0])
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return clean_text(v) if isinstance(v, str) else v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise Unsupported("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise Unsupported("suffix (fill-in-the-middle) is not supported")
        return v


# OpenAI's limit on inputs in one embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(Lenient):
    """POST /v1/embeddings, as OpenAI's: `input` is a string, a list of
    strings, a list of token ids (one input) or a list of such lists.
    `truncate` is Ollama's: cut each input to the model's limit instead of
    refusing it."""

    model: ModelName
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=65_536)
    truncate: bool = False
    keep_alive: KeepAlive = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, v: str | list) -> str | list:
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if len(v) > MAX_EMBEDDING_INPUTS:
                raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs in one request")
            if isinstance(v[0], list) and any(not ids for ids in v):
                raise ValueError("a list of token ids must not be empty")
            if isinstance(v[0], str) and any(not text for text in v):
                raise ValueError("an input must not be an empty string")
        elif not v:
            raise ValueError("must not be an empty string")
        return v

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: strings (clean Unicode), or token-id lists."""
        v = self.input
        if isinstance(v, str):
            return [clean_text(v)]
        if isinstance(v[0], int):
            return [list(v)]  # type: ignore[arg-type]
        if isinstance(v[0], str):
            return [clean_text(t) for t in v]  # type: ignore[arg-type]
        return [list(ids) for ids in v]  # type: ignore[union-attr]


# Cohere's limit on documents in one rerank request; a text's length in characters.
MAX_RERANK_DOCUMENTS = 1000
MAX_RERANK_TEXT = 200_000


class RerankRequest(Lenient):
    """POST /v1/rerank (and /rerank, /v2/rerank), the shape Cohere's and
    Jina's clients send: documents as strings or `{text}` objects, the best
    `top_n`, the documents echoed back on `return_documents`, each cut to
    `max_tokens_per_doc` tokens (Cohere's v2); `instruction` is for a
    chat-model reranker (Qwen3-Reranker's task line). Unknown fields (LiteLLM's
    truncation options, rank_fields) are ignored."""

    model: ModelName
    query: str = Field(min_length=1, max_length=MAX_RERANK_TEXT)
    documents: list[Annotated[str, StringConstraints(max_length=MAX_RERANK_TEXT)]] = Field(
        min_length=1, max_length=MAX_RERANK_DOCUMENTS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    max_tokens_per_doc: int | None = Field(default=None, ge=1, le=1_000_000)
    instruction: str | None = Field(default=None, min_length=1, max_length=2000)
    keep_alive: KeepAlive = None

    @field_validator("documents", mode="before")
    @classmethod
    def _texts(cls, v: object) -> object:
        """`{text}` objects (Jina's, Cohere's v1) read as their text."""
        if not isinstance(v, list):
            return v
        out = []
        for i, d in enumerate(v):
            if isinstance(d, dict):
                if not isinstance(d.get("text"), str):
                    raise ValueError(f"documents[{i}] must be a string or an object with a \"text\" string")
                d = d["text"]
            elif not isinstance(d, str):
                raise ValueError(f"documents[{i}] must be a string or an object with a \"text\" string")
            out.append(d)
        return out

    def texts(self) -> list[str]:
        """The documents' texts, clean Unicode."""
        return [clean_text(d) for d in self.documents]


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|.*\[.*\]|function-.*)$")


def is_unsupported(error: dict) -> bool:
    """A pydantic error raised as `Unsupported` (an engine limit, not a
    mistake); pydantic keeps the raised exception in the error's ctx."""
    return isinstance((error.get("ctx") or {}).get("error"), Unsupported)


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None, str]:
    """pydantic/FastAPI validation errors -> (message, param, code) (pure).
    code is unsupported_parameter when every problem is an engine limit
    (Ollama may do better), else invalid_request."""
    if not errors:
        return "invalid request", None, INVALID_REQUEST
    first = errors[0]
    # pydantic names union members in the location ("content.str"): a client
    # wants the field's path only.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_MEMBER.match(str(p))]
    param = ".".join(loc) or None
    code = UNSUPPORTED_PARAMETER if all(is_unsupported(e) for e in errors) else INVALID_REQUEST
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None, INVALID_REQUEST
    msg = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param, code
