"""Errors in OpenAI's format: one exception type, one place that renders it.

Every failure a request can meet is an EngineError with a status, an OpenAI
error `type` and a stable `code` (the gateway and tests match on the code).
"""

from __future__ import annotations

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    401: "authentication_error",  # as the gateway says it (LiteLLM reads invalid_request_error as a 400)
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class EngineError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def __repr__(self) -> str:
        return f"EngineError({self.status}, {self.code!r}, {self.message!r})"


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> EngineError:
    return EngineError(400, message, code=code, param=param)
