"""Stored responses, for the Responses API's `previous_response_id` (and
GET/DELETE /v1/responses/{id}).

One JSON file per response under $MLXD_HOME/state/responses, written
atomically (temp file + rename, mode 0600: it holds conversations), holding
the response object and the chat messages of its whole conversation — what
led to it (less the instructions, which OpenAI does not carry over) and its
answer — so a later request naming it gets those messages before its own
input. Each file stands alone, so removing old ones never breaks a newer
one's chain. The store is bounded: past MAX_STORED_RESPONSES files or
MAX_STORED_BYTES, the oldest go first, and past its time to live
(`engine.stored_responses_ttl`) a response is gone. It lives on disk, so a
restarted (crashed) engine still knows its responses. One owner: the
engine's `Engine` (engine/api/server.py); handlers on the event loop call it.

Each response belongs to who made it: the gateway passes a hash of the
caller's key (`X-Mlxd-Owner`; a caller of the engine's own port, holding the
engine's key, is DIRECT_OWNER). Any other caller is told what an unknown id
gets, so an id says nothing about others' conversations (`visible`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from mlxd.api_errors import PREVIOUS_RESPONSE_NOT_FOUND
from mlxd.durations import NEVER
from mlxd.keyfile import OWNER_HEADER
from mlxd.paths import remove_dead_temps, write_atomic

from ..model.errors import EngineError

log = logging.getLogger("mlxd.engine.responses")

MAX_STORED_RESPONSES = 1_000
MAX_STORED_BYTES = 256 * 2**20
_ID = re.compile(r"resp_[A-Za-z0-9]{1,100}")
DIRECT_OWNER = "engine-key"  # a request to the engine's port without the header
_OWNER = re.compile(r"[0-9a-f]{16,64}")


def owner_of(header: str | None) -> str | None:
    """The owner a request names (pure): the gateway's hash, DIRECT_OWNER
    without the header, None for a malformed one."""
    if header is None:
        return DIRECT_OWNER
    return header if _OWNER.fullmatch(header) else None


def visible(doc: dict[str, Any], owner: str, now: float, stored_at: float, ttl_s: float) -> bool:
    """Whether a stored response is there for `owner` at `now` (pure): its
    owner's (one stored before owners were recorded is nobody's) and not
    past its time to live."""
    return doc.get("owner") == owner and not expired(stored_at, now, ttl_s)


def expired(stored_at: float, now: float, ttl_s: float) -> bool:
    return ttl_s != NEVER and now - stored_at > ttl_s


class ResponseStore:
    def __init__(self, folder: Path, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES,
                 ttl_s: float = NEVER) -> None:
        self.folder = folder
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        # id -> (file size, when stored), oldest first (read on first use)
        self._entries: OrderedDict[str, tuple[int, float]] | None = None

    def _path(self, response_id: str) -> Path | None:
        return self.folder / f"{response_id}.json" if _ID.fullmatch(response_id) else None

    def _index(self) -> OrderedDict[str, tuple[int, float]]:
        if self._entries is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            os.chmod(self.folder, 0o700)
            remove_dead_temps(self.folder)
            found = []
            for entry in os.scandir(self.folder):
                name = entry.name
                if name.endswith(".json") and _ID.fullmatch(name[:-5]):
                    st = entry.stat()
                    found.append((st.st_mtime, name[:-5], st.st_size))
            self._entries = OrderedDict((rid, (size, mtime)) for mtime, rid, size in sorted(found))
        return self._entries

    def _drop_oldest(self, entries: OrderedDict[str, tuple[int, float]], now: float) -> None:
        """Past the bounds, or past their time to live, the oldest go (under the lock)."""
        while entries:
            oldest, (_, stored_at) = next(iter(entries.items()))
            if not (len(entries) > self.max_count or sum(size for size, _ in entries.values()) > self.max_bytes
                    or expired(stored_at, now, self.ttl_s)):
                return
            entries.popitem(last=False)
            (self.folder / f"{oldest}.json").unlink(missing_ok=True)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]], owner: str) -> None:
        """Keep a finished response and its conversation, `owner`'s; the
        oldest go when over the bounds. A failure to write is logged, never
        raised: the client has its answer (a later previous_response_id of it
        is then not found)."""
        path = self._path(response["id"])
        if path is None:
            return
        data = json.dumps({"owner": owner, "response": response, "messages": messages}, ensure_ascii=False).encode()
        if len(data) > self.max_bytes:
            log.warning("response %s not stored: %d bytes, over the store's %d", response["id"], len(data),
                        self.max_bytes)
            return
        now = time.time()
        with self._lock:
            entries = self._index()
            try:
                write_atomic(path, data, mode=0o600, durable=False)
            except OSError as exc:
                log.warning("response %s not stored: %s", response["id"], exc)
                return
            entries.pop(response["id"], None)
            entries[response["id"]] = (len(data), now)
            self._drop_oldest(entries, now)

    def _read(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The stored document, where it is `owner`'s and alive; else None
        (and an expired one is removed)."""
        path = self._path(response_id)
        if path is None:
            return None
        try:
            stored_at = os.stat(path).st_mtime
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None
        if expired(stored_at, time.time(), self.ttl_s):
            self.delete(response_id, doc.get("owner") if isinstance(doc, dict) else None)
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("messages"), list):
            return None
        return doc if visible(doc, owner, time.time(), stored_at, self.ttl_s) else None

    def conversation(self, response_id: str, owner: str) -> list[dict[str, Any]]:
        """The chat messages up to and including the response's answer; the
        400 OpenAI answers for an id it does not know (or another's)."""
        doc = self._read(response_id, owner)
        if doc is None:
            raise EngineError(400, f"previous response with id {response_id[:120]!r} not found (stored with "
                                   "store: false, never stored here -- an answer of the gateway's Ollama fallback "
                                   f"is not --, made with another key, expired or removed: this engine keeps the "
                                   f"latest {self.max_count} responses)",
                              code=PREVIOUS_RESPONSE_NOT_FOUND,
                              param="previous_response_id")
        return doc["messages"]

    def response(self, response_id: str, owner: str) -> dict[str, Any] | None:
        doc = self._read(response_id, owner)
        return doc.get("response") if doc is not None else None

    def delete(self, response_id: str, owner: str | None) -> bool:
        """Remove `owner`'s response; False where there is none of theirs."""
        path = self._path(response_id)
        if path is None:
            return False
        with self._lock:
            try:
                doc = json.loads(path.read_bytes())
            except (OSError, ValueError):
                doc = None
            if not isinstance(doc, dict) or doc.get("owner") != owner:
                return False
            self._index().pop(response_id, None)
            try:
                path.unlink()
            except FileNotFoundError:
                return False
        return True
