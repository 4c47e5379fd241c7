"""Errors in OpenAI's format (Anthropic's on its Messages routes): one
exception type, one place that renders it.

Every failure a request can meet is an EngineError with a status, an OpenAI
error `type` (from the status, by mlxd.api_errors' table, shared with the
gateway) and a stable `code` (the gateway and tests match on the code).
"""

from __future__ import annotations

import re

from mlxd.api_errors import ERROR_CODE_HEADER, ERROR_PARAM_HEADER, INVALID_REQUEST, error_body_for, error_type


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

    def body(self, path: str = "") -> dict:
        """The error object in the shape of the route at `path` (OpenAI's but on Anthropic's routes)."""
        return error_body_for(path, self.status, self.message, self.code, self.param)

    def headers(self) -> dict[str, str]:
        """Retry-After where it has one; its code and param (mlxd.api_errors.ERROR_CODE_HEADER)."""
        out = {ERROR_CODE_HEADER: header_safe(self.code)} | (
            {ERROR_PARAM_HEADER: header_safe(self.param)} if self.param else {})
        return out | ({"Retry-After": str(self.retry_after)} if self.retry_after is not None else {})

    def __repr__(self) -> str:
        return f"EngineError({self.status}, {self.code!r}, {self.message!r})"


def header_safe(value: str, limit: int = 200) -> str:
    """A value a header can carry (pure): ASCII, one line, bounded (a param may echo a client's key)."""
    return " ".join(value.split())[:limit].strip().encode("ascii", "replace").decode()  # no end space: h11's rule


def bad_request(message: str, *, param: str | None = None, code: str = INVALID_REQUEST) -> EngineError:
    return EngineError(400, message, code=code, param=param)


# An MLX error that is the backend's capability limit (an op or dtype it does not run), not a device fault:
# deterministic for the model as loaded, so the engine answers it and reloads the model in float32 instead of
# exiting (engine/core/engine_core.py). Device faults (Metal's, CUDA's, memory) never match.
BACKEND_LIMIT_PATTERNS = (r"Currently only supports", r"\bnot (?:yet )?supported\b", r"\bnot implemented\b",
                          r"\bno implementation\b", r"^\[[\w:]+::eval\]")
DEVICE_FAULT_PATTERNS = (r"\[METAL\]", r"\[CUDA\]", r"\bcuda\w*Error", r"[Oo]ut of memory", r"Insufficient Memory",
                         r"\[metal::malloc\]", r"\[malloc\]", r"Command buffer")
_BACKEND_LIMIT = re.compile("|".join(BACKEND_LIMIT_PATTERNS), re.IGNORECASE | re.MULTILINE)
_DEVICE_FAULT = re.compile("|".join(DEVICE_FAULT_PATTERNS))
BACKEND_UNSUPPORTED = "backend_unsupported"


def backend_limit(exc: BaseException) -> str | None:
    """The backend's capability limit that `exc` reports (its message, one
    line), or None for anything else -- a device fault above all (pure)."""
    message = str(exc).strip()
    if type(exc) is NotImplementedError:  # mlx-lm's "... NYI": deterministic, never a device's fault
        return (message.splitlines()[0][:300] if message else "not implemented")
    if type(exc) not in (ValueError, RuntimeError):  # MLX raises exactly these; subclasses are ours or a test's
        return None
    if not message or _DEVICE_FAULT.search(message) or not _BACKEND_LIMIT.search(message):
        return None
    return message.splitlines()[0][:300]


def backend_unsupported(model_id: str, limit: str, reloading: bool) -> EngineError:
    """The answer to the requests a backend limit failed (a 500: the server's
    side; the gateway's fallback answers a retry meanwhile)."""
    then = ("the engine reloads it with float32 weights; retry" if reloading
            else "it is loaded as float32 already; this backend cannot serve it")
    return EngineError(500, f"the MLX backend cannot run model {model_id!r} as loaded ({limit}): {then}",
                       code=BACKEND_UNSUPPORTED, retry_after=5 if reloading else None)
