"""The engine's side of poison-request quarantine: refuse requests whose
fingerprint the crash listener quarantined (it crashed the engine alone,
twice, or again when retried alone), and decode alone the suspects (in
flight at a crash with others), so that a retry is evidence either way. The
listener owns the list and writes it atomically; the engine only reads it,
again whenever the file changes."""

from __future__ import annotations

import os
import time
from pathlib import Path

from mlxd.records import Quarantine

from ..model.errors import EngineError


class QuarantineList:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: float | None = None
        self._until: dict[str, float] = {}
        self._suspects: dict[str, float] = {}

    def _reload(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            self._mtime, self._until, self._suspects = None, {}, {}
            return
        if mtime != self._mtime:
            read = Quarantine.read(self.path) or Quarantine()
            self._until, self._suspects = read.fingerprints, read.suspects
            self._mtime = mtime

    def suspect(self, fingerprint: str, now: float | None = None) -> bool:
        """Whether the request was in flight at a recent crash with others: it is decoded alone."""
        self._reload()
        until = self._suspects.get(fingerprint)
        return until is not None and (time.time() if now is None else now) < until

    def check(self, fingerprint: str, now: float | None = None) -> None:
        """Raise the 400 `request_quarantined` refusal for a poison request."""
        self._reload()
        until = self._until.get(fingerprint)
        now = time.time() if now is None else now
        if until is not None and now < until:
            raise EngineError(400, f"this request crashed the engine (alone in flight, twice); it is refused until "
                                   f"{time.strftime('%H:%M:%S', time.localtime(until))} "
                                   f"(fingerprint {fingerprint})", code="request_quarantined")
