"""Errors in OpenAI's format: one exception type, one place that renders it.

Every failure a request can meet is an EngineError with a status, an OpenAI
error `type` (from the status, by mlxd.api_errors' table, shared with the
gateway) and a stable `code` (the gateway and tests match on the code).
"""

from __future__ import annotations

from mlxd.api_errors import INVALID_REQUEST, error_body, error_type


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
        return error_type(self.status)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def __repr__(self) -> str:
        return f"EngineError({self.status}, {self.code!r}, {self.message!r})"


def bad_request(message: str, *, param: str | None = None, code: str = INVALID_REQUEST) -> EngineError:
    return EngineError(400, message, code=code, param=param)
