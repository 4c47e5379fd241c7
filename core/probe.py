"""One HTTP GET of a JSON document that never raises: the health probes of
the crash listener, `mlxd up`, `mlxd status` and `mlxd doctor`.

Why one place: the thing probed can die mid-answer (that is what mlxd is
for), and urllib then raises more than OSError -- http.client.IncompleteRead
on a truncated body, BadStatusLine on garbage. One such exception once
killed the listener's supervision thread (found by bench/recovery.py).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any


def get_json(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> tuple[int | None, Any]:
    """(HTTP status, parsed JSON body). (None, None) when no whole answer came
    (refused, timed out, cut off, not HTTP); the body is None when it is not
    JSON. A 4xx/5xx is an answer: its status and body are returned.
    `headers`: the engine's key (mlxd.keyfile.engine_headers), for one."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status = e.code
        try:
            raw = e.read()
        except (OSError, http.client.HTTPException):
            raw = b""
    except (OSError, ValueError, http.client.HTTPException):
        return None, None
    try:
        return status, json.loads(raw)
    except (ValueError, RecursionError):
        return status, None
