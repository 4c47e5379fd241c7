"""The one way the gateway answers an error: OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`, mlxd.api_errors, shared
with the engine), or Anthropic's on its Messages routes, sent over raw ASGI."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mlxd.api_errors import error_body_for

Headers = list[tuple[bytes, bytes]]
JSON = (b"content-type", b"application/json")
# Where the answer is the engine's error as it wrote it, what the fallback did beside it.
FALLBACK_HEADER = b"x-mlxd-fallback"
FALLBACK_NOTE_CHARS = 200
# "litellm.BadRequestError: OpenAIException - ", "litellm.RateLimitError: RateLimitError: OpenAIException - "
LITELLM_WRAPPER = re.compile(r"(?:[\w.]+: )*\w*Exception - ")
FALLBACK_FAILED = re.compile(r"Fallback to (\S+) also failed: (.*)", re.DOTALL)  # LiteLLM's words for it


def fallback_note(target: str, said: str) -> bytes:
    """`x-mlxd-fallback`'s value (pure): which fallback failed, and its word,
    on one line of ASCII, without LiteLLM's exception names, and no space at
    either end (h11 refuses such a header, and the connection would drop)."""
    why = LITELLM_WRAPPER.sub("", " ".join(said.split()))
    return f"{target} failed too: {why}"[:FALLBACK_NOTE_CHARS].strip().encode("ascii", "replace")


@dataclass(frozen=True)
class ApiError:
    status: int
    message: str
    code: str
    type: str | None = None  # None: the status's (mlxd.api_errors.error_type)
    param: str | None = None

    def body(self, path: str = "") -> bytes:
        """The error object in the shape of the route at `path` (Anthropic's on /v1/messages, else OpenAI's)."""
        return json.dumps(error_body_for(path, self.status, self.message, self.code, self.param, self.type)).encode()


async def send_json(send: Any, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = (JSON,)) -> None:
    """A whole answer in two ASGI messages; content-length is added here."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Any, error: ApiError, extra_headers: Headers | None = None, path: str = "") -> None:
    await send_json(send, error.status, error.body(path), [JSON, *(extra_headers or [])])
