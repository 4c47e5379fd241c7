"""The status page: /ui, a static page (gateway/ui/: HTML, one script, one
style sheet) served without a key, and /mlxd/status, the keyed JSON it
reads.

The split is strict: the open files hold no data and no key (the page asks
for the key and sends it as `Authorization: Bearer`, never in a URL);
everything the page shows comes from /mlxd/status behind the key guard
(gateway/app.py). Its document: what `mlxd status --json` says
(supervisor/status.py's collect_status, run in a thread: it blocks on
XML-RPC, HTTP and files), the crash journal's latest exits, the model list
(mlxd.model_list) and the last hour's history (gateway/status_history.py).
`page_document` decides what goes in (pure); `StatusPage` is its shell.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterable

from mlxd.config import Config
from mlxd.keyfile import KeyFile
from mlxd.model_list import ModelRow, gather_rows
from mlxd.records import CrashRecord, StartedWith
from mlxd.reports import StatusReport
from mlxd.supervisor.journal import read_records
from mlxd.supervisor.status import collect_status

from .errors import JSON, ApiError, send_error, send_json
from .status_history import SPAN_S, HistorySampler, Point

log = logging.getLogger("mlxd.gateway.status")

PAGE_PATH = "/ui"
DATA_PATH = "/mlxd/status"  # keyed: the guard admits it with the key, like the API's routes
UI_DIR = Path(__file__).resolve().parent / "ui"
ASSETS = {"index.html": b"text/html; charset=utf-8", "app.js": b"text/javascript; charset=utf-8",
          "style.css": b"text/css; charset=utf-8"}
# Only the page's own files, only the gateway's own fetches: no inline script, no other origin.
PAGE_HEADERS = [(b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; "
                 b"connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                 b"frame-ancestors 'none'"),
                (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                (b"cache-control", b"no-cache")]
JOURNAL_LIMIT = 50  # the timeline's latest exits


READ_METHODS = ("GET", "HEAD")


def not_allowed(method: str) -> ApiError:
    return ApiError(405, f"{method[:20]} is not allowed here: the status page only reads (GET)", "method_not_allowed")


def asset_for(path: str) -> str | None:
    """The page's file an open path names, or None: /ui and /ui/ are the
    page, /ui/<name> its script and style sheet (pure)."""
    if path in (PAGE_PATH, PAGE_PATH + "/"):
        return "index.html"
    name = path.removeprefix(PAGE_PATH + "/")
    return name if path.startswith(PAGE_PATH + "/") and name in ASSETS else None


def timeline(records: Iterable[CrashRecord], limit: int = JOURNAL_LIMIT) -> list[dict[str, Any]]:
    """The journal's latest exits, newest first, as the page's timeline
    shows them: when, what kind, how it ended, on which model (pure). Its
    stderr tail and memory figures stay in the journal (`mlxd logs`)."""
    latest = list(records)[-limit:] if limit > 0 else []
    return [{"time": r.time, "class": r.klass, "crash": r.is_crash, "signal": r.signal, "exit_code": r.exit_code,
             "model": r.model, "request_id": r.request_id, "uptime_s": r.uptime_s, "restart_in_s": r.restart_in_s,
             "degraded": r.degraded} for r in reversed(latest)]


def page_document(status: StatusReport, records: list[CrashRecord], rows: list[ModelRow], budget_bytes: int,
                  points: list[Point], interval_s: float) -> dict[str, Any]:
    """/mlxd/status's body: the status report, the journal's timeline, the
    models and the history (pure)."""
    return {"time": status.time, "status": status.to_json(), "journal": timeline(records),
            "models": {"budget_bytes": budget_bytes, "models": [asdict(r) for r in rows]},
            "history": {"interval_s": interval_s, "span_s": SPAN_S, "points": [p.to_json() for p in points]}}


def gather(config: Config, budget_bytes: int) -> tuple[StatusReport, list[CrashRecord], list[ModelRow]]:
    """What the page shows, read now (blocking I/O: run in a thread)."""
    status = replace(collect_status(config), started_with=StartedWith.read(config.paths.started_with))
    rows = gather_rows(config, budget_bytes, status.engine.health)
    return status, read_records(config.paths.journal), rows


class StatusPage:
    """Serves the page's files and its document; owns the history sampler
    (started and stopped with the gateway's lifespan)."""

    def __init__(self, config: Config, budget_bytes: int, engine_key: KeyFile) -> None:
        self.config = config
        self.budget_bytes = budget_bytes
        self.history = HistorySampler(config.engine_url, config.gateway.status_sample_s, engine_key)
        self.assets = {name: (UI_DIR / name).read_bytes() for name in ASSETS}  # a few KiB, read once
        self.gathering: asyncio.Future | None = None  # one gather at a time, shared by concurrent requests

    async def serve_asset(self, name: str, method: str, send: Any) -> None:
        if method not in READ_METHODS:
            await send_error(send, not_allowed(method), [(b"allow", b"GET, HEAD")])
            return
        body = self.assets[name]
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", ASSETS[name]), (b"content-length", str(len(body)).encode()), *PAGE_HEADERS]})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})

    async def serve_document(self, method: str, send: Any) -> None:
        if method != "GET":
            await send_error(send, not_allowed(method), [(b"allow", b"GET")])
            return
        if self.gathering is None or self.gathering.done():
            self.gathering = asyncio.ensure_future(asyncio.to_thread(gather, self.config, self.budget_bytes))
        try:
            status, records, rows = await asyncio.shield(self.gathering)
        except Exception as exc:  # noqa: BLE001 - the page says why; the gateway serves on
            log.exception("status page: gathering the status failed")
            await send_error(send, ApiError(500, f"could not gather the status: {exc}"[:300], "status_failed"))
            return
        doc = page_document(status, records, rows, self.budget_bytes, self.history.points(time.time()),
                            self.history.interval_s)
        await send_json(send, 200, json.dumps(doc, default=str).encode(), [JSON, (b"cache-control", b"no-store")])

    def lifespan_receive(self, receive: Any) -> Any:
        """`receive` for the lifespan: the sampler starts with the gateway's
        startup and stops at its shutdown (LiteLLM's own lifespan runs as before)."""
        async def watched() -> dict:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.history.start()
            elif message["type"] == "lifespan.shutdown":
                await self.history.stop()
            return message

        return watched
