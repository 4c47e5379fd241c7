"""The one way the gateway answers an error: OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`), sent over raw ASGI."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Headers = list[tuple[bytes, bytes]]
JSON = (b"content-type", b"application/json")


@dataclass(frozen=True)
class ApiError:
    status: int
    message: str
    code: str
    type: str = "invalid_request_error"
    param: str | None = None

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                     "code": self.code}}).encode()


async def send_json(send: Any, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = (JSON,)) -> None:
    """A whole answer in two ASGI messages; content-length is added here."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Any, error: ApiError, extra_headers: Headers | None = None) -> None:
    await send_json(send, error.status, error.body(), [JSON, *(extra_headers or [])])
