"""The engine's side of poison-request quarantine: refuse requests whose
fingerprint the crash listener quarantined (it was in flight in two
crashes). The listener owns the list and writes it atomically; the engine
only reads it, again whenever the file changes."""

from __future__ import annotations

import os
import time
from pathlib import Path

from mlxd.records import Quarantine

from ..core.errors import EngineError


class QuarantineList:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: float | None = None
        self._until: dict[str, float] = {}

    def _reload(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            self._mtime, self._until = None, {}
            return
        if mtime != self._mtime:
            self._until = (Quarantine.read(self.path) or Quarantine()).fingerprints
            self._mtime = mtime

    def check(self, fingerprint: str, now: float | None = None) -> None:
        """Raise the 400 `request_quarantined` refusal for a poison request."""
        self._reload()
        until = self._until.get(fingerprint)
        now = time.time() if now is None else now
        if until is not None and now < until:
            raise EngineError(400, f"this request crashed the engine twice; it is refused until "
                                   f"{time.strftime('%H:%M:%S', time.localtime(until))} "
                                   f"(fingerprint {fingerprint})", code="request_quarantined")
