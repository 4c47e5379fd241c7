"""The error contract the engine and the gateway share (pure, no MLX).

Both answer errors in OpenAI's shape, `{"error": {"message", "type",
"param", "code"}}`. The `type` follows from the HTTP status, by the one
table below; the `code` is ours and stable: the gateway decides on codes,
never on a message's wording, so a reworded message changes no routing.
Anthropic's Messages routes answer in Anthropic's shape instead, with the
same code inside (`error_body_for`).
"""

from __future__ import annotations

from typing import Any

ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    401: "authentication_error",  # LiteLLM reads invalid_request_error as a 400
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# Codes whose meaning crosses the process boundary (the engine sets them,
# gateway/routing.py decides on them).
INVALID_REQUEST = "invalid_request"  # malformed input: no backend would do better
INVALID_MESSAGES = "invalid_messages"  # messages the model's chat template refuses: the same
# A valid request beyond this engine (n > 1, logprobs, a structured
# response_format...): Ollama may serve it. OpenAI's own code for such a field.
UNSUPPORTED_PARAMETER = "unsupported_parameter"
# A Responses API request naming a response this engine does not hold: Ollama
# would not know it either (LiteLLM's Responses bridge would answer without the
# conversation), so the engine's 400 stands, as OpenAI's does.
PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
CLIENT_MISTAKES = frozenset({INVALID_REQUEST, INVALID_MESSAGES, PREVIOUS_RESPONSE_NOT_FOUND})
# The engine's error answers say their code and param in headers too: LiteLLM
# keeps an upstream's headers (as llm_provider-<name>) where it keeps only the
# message of some errors (a 429's), so the gateway can give the client the
# engine's error whole (gateway/app.py, unwrap_engine_error).
ERROR_CODE_HEADER = "x-mlxd-error-code"
ERROR_PARAM_HEADER = "x-mlxd-error-param"


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status (pure)."""
    return ERROR_TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str, param: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    """The error object; `type` defaults to the status's."""
    return {"error": {"message": message, "type": type or error_type(status), "param": param, "code": code}}


# Anthropic's Messages API answers errors in its own shape,
# `{"type": "error", "error": {"type", "message"}}`, typed by status with its
# own names; its clients (Claude Code, the `anthropic` SDK) read that.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
ANTHROPIC_ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """The error object in Anthropic's shape (pure), our `code` and `param`
    kept inside it: the gateway decides on the code, as on the other routes."""
    kind = ANTHROPIC_ERROR_TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message, "code": code, "param": param}}


def error_body_for(path: str, status: int, message: str, code: str, param: str | None = None,
                   type: str | None = None) -> dict[str, Any]:
    """The error object in the shape the route's clients read: Anthropic's on
    its Messages routes, else OpenAI's (pure)."""
    if path in ANTHROPIC_PATHS:
        return anthropic_error_body(status, message, code, param)
    return error_body(status, message, code, param, type)
