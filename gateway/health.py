"""The gateway's open health routes, answered without a key.

/mlxd/health is ours (liveness for `mlxd status` and readiness polling).
/health/liveliness, /health/liveness and /health/readiness are LiteLLM's:
compose files and orchestrators written for a LiteLLM proxy probe them
without a key. They answer in LiteLLM's shape (checked on 1.106.2:
`"I'm alive!"`, and `{"status": "healthy", "db": "Not connected"}` without a
database) and say no more than LiteLLM's own open routes: no model names,
keys, versions or config.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from mlxd.keyfile import KeyFile

from .errors import send_json

OWN_PATH = "/mlxd/health"
LIVENESS_PATHS = frozenset({"/health/liveliness", "/health/liveness"})
READINESS_PATH = "/health/readiness"
PATHS = LIVENESS_PATHS | {OWN_PATH, READINESS_PATH}
PROBE_TIMEOUT_S = 2.0


def readiness(engine_answers: bool, ollama_answers: bool) -> tuple[int, dict]:
    """Ready when a backend can answer: the engine, or Ollama as its fallback (pure)."""
    if engine_answers or ollama_answers:
        return 200, {"status": "healthy", "db": "Not connected"}
    return 503, {"status": "unhealthy", "db": "Not connected"}


class Health:
    def __init__(self, engine_url: str, ollama_url: str, engine_key: KeyFile) -> None:
        self.engine_health = engine_url + "/health"
        self.engine_key = engine_key
        self.ollama_version = ollama_url.rstrip("/") + "/api/version"
        self.session: aiohttp.ClientSession | None = None

    async def answer(self, path: str, send: Any) -> None:
        if path == OWN_PATH:  # open, so it says nothing but that the gateway is up (`mlxd status` reads it)
            status, doc = 200, {"status": "ok"}
        elif path in LIVENESS_PATHS:
            status, doc = 200, "I'm alive!"
        else:
            engine, ollama = await asyncio.gather(self._answers(self.engine_health, self.engine_key.headers()),
                                                  self._answers(self.ollama_version))
            status, doc = readiness(engine, ollama)
        await send_json(send, status, json.dumps(doc).encode())

    async def _answers(self, url: str, headers: dict[str, str] | None = None) -> bool:
        if self.session is None or self.session.closed:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S))
        try:
            async with self.session.get(url, headers=headers) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False
