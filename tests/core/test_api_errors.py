"""The error contract the engine and the gateway share: the HTTP status ->
OpenAI error type table, and both sides render errors by it."""

import json

import pytest

from mlxd.api_errors import error_type
from mlxd.engine.model.errors import EngineError
from mlxd.gateway.errors import ApiError


@pytest.mark.parametrize("status, expected", [
    (400, "invalid_request_error"),
    (401, "authentication_error"),
    (404, "invalid_request_error"),
    (405, "invalid_request_error"),
    (413, "invalid_request_error"),
    (418, "invalid_request_error"),  # any other 4xx
    (422, "invalid_request_error"),
    (429, "rate_limit_error"),
    (500, "server_error"),
    (502, "server_error"),  # any other 5xx
    (503, "service_unavailable_error"),
    (504, "timeout_error"),
])
def test_error_type_by_status(status, expected):
    assert error_type(status) == expected
    engine = EngineError(status, "m", code="c", param="p").body()
    gateway = json.loads(ApiError(status, "m", "c", param="p").body())
    assert engine == gateway == {"error": {"message": "m", "type": expected, "param": "p", "code": "c"}}


def test_the_gateway_may_name_another_type():
    """A gateway failure in LiteLLM's plain text is a server error whatever its status."""
    assert json.loads(ApiError(400, "m", "gateway_error", "server_error").body())["error"]["type"] == "server_error"


@pytest.mark.parametrize("status, expected", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error"), (504, "api_error"),
])
def test_anthropics_routes_get_anthropics_shape_from_both_sides(status, expected):
    """Anthropic's type names, our code and param kept inside (the gateway decides on the code)."""
    engine = EngineError(status, "m", code="c", param="p").body("/v1/messages")
    gateway = json.loads(ApiError(status, "m", "c", param="p").body("/v1/messages"))
    assert engine == gateway == {"type": "error", "error": {"type": expected, "message": "m", "code": "c",
                                                            "param": "p"}}
    assert "type" not in EngineError(status, "m", code="c").body("/v1/chat/completions")
