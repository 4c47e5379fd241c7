"""The limits of every request field, as one table (docs/LIMITS.md).

Read from the request models themselves (their JSON schemas: lengths,
counts, ranges), plus the limits their validators, the engine's config and
the gateway enforce beyond a schema (`BEYOND_THE_SCHEMA`). Each row's field
is what a refusal names in `param`. Pure: no MLX.

    python -m mlxd.engine.api.request_limits > docs/LIMITS.md
"""

from __future__ import annotations

from typing import Any

from .messages_api import MessagesRequest
from .request_fields import MAX_STOP_SEQUENCES, MAX_TOKENS_SANITY
from .request_schema import (MAX_EMBEDDING_INPUTS, MAX_RERANK_DOCUMENTS, ChatCompletionRequest, CompletionRequest,
                             EmbeddingRequest, RerankRequest)
from .responses_api import ResponsesRequest

ROUTES = (("POST /v1/chat/completions", ChatCompletionRequest), ("POST /v1/completions", CompletionRequest),
          ("POST /v1/responses", ResponsesRequest), ("POST /v1/messages", MessagesRequest),
          ("POST /v1/embeddings", EmbeddingRequest), ("POST /v1/rerank", RerankRequest))
BOUNDS = (("minLength", "length ≥ {}"), ("maxLength", "length ≤ {}"), ("minItems", "items ≥ {}"),
          ("maxItems", "items ≤ {}"), ("minProperties", "entries ≥ {}"), ("maxProperties", "entries ≤ {}"),
          ("minimum", "≥ {}"), ("exclusiveMinimum", "> {}"), ("maximum", "≤ {}"), ("exclusiveMaximum", "< {}"))
# (route, field, limit, what answers beyond it): what no schema says.
BEYOND_THE_SCHEMA = (
    ("every route", "(the body)", "JSON nested at most ~1,000 levels deep",
     "400 `invalid_request`, \"nests JSON arrays and objects too deep\""),
    ("every route", "(the body)", "a JSON object", "400 `invalid_request`, the parser's message"),
    ("chat, completions, responses, messages", "(the prompt)",
     "`[engine] max_prompt_tokens` tokens, with the answer's within the model's context",
     "400 `context_length_exceeded` (or the middle cut, `context_overflow = \"truncate_middle\"`)"),
    ("chat, completions", "max_tokens / max_completion_tokens",
     f"≤ {MAX_TOKENS_SANITY:,}; above `[engine] max_tokens_cap` it is lowered to the cap",
     "400 `invalid_request`"),
    ("chat, completions", "stop", f"at most {MAX_STOP_SEQUENCES} sequences", "400 `invalid_request`"),
    ("embeddings", "input", f"at most {MAX_EMBEDDING_INPUTS:,} inputs", "400 `invalid_request`"),
    ("rerank", "documents", f"at most {MAX_RERANK_DOCUMENTS:,}, strings or objects with a `text` string; each pair "
     "cut to the reranker's limit (a cross-encoder's tokens, an embedding model's inputs)",
     "400 `invalid_request`"),
    ("rerank", "instruction", "only for a chat-model reranker (`[rerankers.ID] chat_model`)", "400 `invalid_request`"),
    ("rerank", "model", "a `[rerankers]` id (a chat or embedding model's name says which names rerank)",
     "400 `invalid_request` / 404 `model_not_found`"),
    ("every route", "model", "a configured model id or alias, exactly", "404 `model_not_found`"),
    ("responses", "previous_response_id", "a response stored by the same key, within `stored_responses_ttl`",
     "400 `previous_response_not_found`"),
)


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    return defs[ref.rsplit("/", 1)[1]] if isinstance(ref, str) else schema


def schema_limits(schema: dict[str, Any], defs: dict[str, Any], path: str = "",
                  seen: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(field path, its bounds) for every bounded field under `schema`
    (pure); arrays' items are `field[]`; a model met again below itself is
    not walked twice."""
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if ref in seen:
            return []
        seen = seen | {ref}
    schema = _resolve(schema, defs)
    rows: list[tuple[str, str]] = []
    bounds = [text.format(schema[key]) for key, text in BOUNDS if key in schema]
    if bounds and path:
        rows.append((path, ", ".join(bounds)))
    for option in schema.get("anyOf", []) + schema.get("oneOf", []) + schema.get("allOf", []):
        rows += schema_limits(option, defs, path, seen)
    if isinstance(schema.get("items"), dict):
        rows += schema_limits(schema["items"], defs, f"{path}[]", seen)
    for name, sub in (schema.get("properties") or {}).items():
        rows += schema_limits(sub, defs, f"{path}.{name}" if path else name, seen)
    if isinstance(schema.get("additionalProperties"), dict):
        rows += schema_limits(schema["additionalProperties"], defs, f"{path}.*", seen)
    return list(dict.fromkeys(rows))  # anyOf branches repeat a field's bounds


def limits_markdown() -> str:
    lines = ["# Request limits", "",
             "Generated from the request models (`python -m mlxd.engine.api.request_limits > docs/LIMITS.md`; a "
             "test keeps it current). A request beyond a limit gets a 400 in OpenAI's shape (Anthropic's on "
             "`/v1/messages`) whose `param` names the field, as below (`[]`: each item of an array, `.*`: each "
             "value of an object), and the service stays up. The gateway validates with the same models.", "",
             "| route | field (`param`) | limit |", "|---|---|---|"]
    for route, model in ROUTES:
        schema = model.model_json_schema()
        for field, bounds in schema_limits(schema, schema.get("$defs", {})):
            lines.append(f"| `{route}` | `{field}` | {bounds} |")
    lines += ["", "Beyond what the schemas say:", "", "| routes | field | limit | beyond it |", "|---|---|---|---|"]
    lines += [f"| {route} | {field} | {limit} | {answer} |" for route, field, limit, answer in BEYOND_THE_SCHEMA]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(limits_markdown(), end="")
