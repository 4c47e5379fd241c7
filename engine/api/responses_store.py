"""Stored responses, for the Responses API's `previous_response_id` (and
GET/DELETE /v1/responses/{id}).

One JSON file per response under $MLXD_HOME/state/responses, written
atomically (temp file + rename, mode 0600: it holds conversations), holding
the response object and the chat messages of its whole conversation — what
led to it (less the instructions, which OpenAI does not carry over) and its
answer — so a later request naming it gets those messages before its own
input. Each file stands alone, so removing old ones never breaks a newer
one's chain. The store is bounded: past MAX_STORED_RESPONSES files or
MAX_STORED_BYTES, the oldest go first. It lives on disk, so a restarted
(crashed) engine still knows its responses. One owner: the engine's
`Engine` (engine/api/server.py); handlers on the event loop call it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from mlxd.api_errors import PREVIOUS_RESPONSE_NOT_FOUND
from mlxd.paths import remove_dead_temps, write_atomic

from ..model.errors import EngineError

log = logging.getLogger("mlxd.engine.responses")

MAX_STORED_RESPONSES = 1_000
MAX_STORED_BYTES = 256 * 2**20
_ID = re.compile(r"resp_[A-Za-z0-9]{1,100}")


class ResponseStore:
    def __init__(self, folder: Path, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.folder = folder
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] | None = None  # id -> file size, oldest first (read on first use)

    def _path(self, response_id: str) -> Path | None:
        return self.folder / f"{response_id}.json" if _ID.fullmatch(response_id) else None

    def _index(self) -> OrderedDict[str, int]:
        if self._sizes is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            os.chmod(self.folder, 0o700)
            remove_dead_temps(self.folder)
            found = []
            for entry in os.scandir(self.folder):
                name = entry.name
                if name.endswith(".json") and _ID.fullmatch(name[:-5]):
                    st = entry.stat()
                    found.append((st.st_mtime, name[:-5], st.st_size))
            self._sizes = OrderedDict((rid, size) for _, rid, size in sorted(found))
        return self._sizes

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Keep a finished response and its conversation; the oldest go when
        over the bounds. A failure to write is logged, never raised: the
        client has its answer (a later previous_response_id of it is then
        not found)."""
        path = self._path(response["id"])
        if path is None:
            return
        data = json.dumps({"response": response, "messages": messages}, ensure_ascii=False).encode()
        if len(data) > self.max_bytes:
            log.warning("response %s not stored: %d bytes, over the store's %d", response["id"], len(data),
                        self.max_bytes)
            return
        with self._lock:
            sizes = self._index()
            try:
                write_atomic(path, data, mode=0o600, durable=False)
            except OSError as exc:
                log.warning("response %s not stored: %s", response["id"], exc)
                return
            sizes[response["id"]] = len(data)
            while len(sizes) > self.max_count or sum(sizes.values()) > self.max_bytes:
                oldest, _ = sizes.popitem(last=False)
                (self.folder / f"{oldest}.json").unlink(missing_ok=True)

    def _read(self, response_id: str) -> dict[str, Any] | None:
        path = self._path(response_id)
        if path is None:
            return None
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("messages"), list) else None

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages up to and including the response's answer; the
        400 OpenAI answers for an id it does not know."""
        doc = self._read(response_id)
        if doc is None:
            raise EngineError(400, f"previous response with id {response_id[:120]!r} not found (stored with "
                                   "store: false, never stored here -- an answer of the gateway's Ollama fallback "
                                   f"is not --, or removed: this engine keeps the latest {self.max_count} responses)",
                              code=PREVIOUS_RESPONSE_NOT_FOUND,
                              param="previous_response_id")
        return doc["messages"]

    def response(self, response_id: str) -> dict[str, Any] | None:
        doc = self._read(response_id)
        return doc.get("response") if doc is not None else None

    def delete(self, response_id: str) -> bool:
        path = self._path(response_id)
        if path is None:
            return False
        with self._lock:
            self._index().pop(response_id, None)
            try:
                path.unlink()
            except FileNotFoundError:
                return False
        return True
