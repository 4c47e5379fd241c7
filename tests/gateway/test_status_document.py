"""What the status page may serve without a key, and what its keyed document
holds (gateway/status_page.py's pure parts), as tables."""

from __future__ import annotations

import re

import pytest

from mlxd.gateway.app import admit
from mlxd.gateway.status_history import Point
from mlxd.gateway.status_page import ASSETS, UI_DIR, asset_for, page_document, timeline
from mlxd.model_list import ModelRow
from mlxd.records import CrashRecord
from mlxd.reports import EngineHealth, EngineProbe, StatusReport, SupervisordState


@pytest.mark.parametrize("path, asset", [
    ("/ui", "index.html"),
    ("/ui/", "index.html"),
    ("/ui/app.js", "app.js"),
    ("/ui/style.css", "style.css"),
    ("/ui/index.html", "index.html"),
    ("/ui/../key", None),             # nothing outside the page's own files
    ("/ui/ui/app.js", None),
    ("/ui/secrets.json", None),
    ("/uix", None),
    ("/mlxd/status", None),           # the data: behind the key
    ("/", None),
])
def test_only_the_pages_own_files_are_open(path, asset):
    assert asset_for(path) == asset


def test_every_asset_is_installed_with_the_gateway():
    assert {p.name for p in UI_DIR.iterdir()} == set(ASSETS)


def test_the_page_holds_no_inline_script_and_loads_nothing_from_elsewhere():
    html = (UI_DIR / "index.html").read_text()
    assert '<script src="/ui/app.js"' in html and "<script>" not in html and not re.search(r"\son\w+=", html)
    for name in ASSETS:
        text = (UI_DIR / name).read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text, name


@pytest.mark.parametrize("path, given, status", [
    ("/mlxd/status", None, 401),
    ("/mlxd/status", "sk-wrong", 401),
    ("/mlxd/status", "sk-right", None),       # goes on, to the status page's document
    ("/mlxd/statusx", "sk-right", 404),
])
def test_the_document_needs_the_key(path, given, status):
    refusal = admit("http", path, "sk-right", given)
    assert (refusal.status if refusal else None) == status


def crash(t: float, klass: str = "sigabrt", **kw) -> CrashRecord:
    return CrashRecord(time=t, klass=klass, **kw)


@pytest.mark.parametrize("records, limit, times", [
    ([], 50, []),
    ([crash(1.0), crash(2.0), crash(3.0)], 50, [3.0, 2.0, 1.0]),   # newest first
    ([crash(float(t)) for t in range(10)], 3, [9.0, 8.0, 7.0]),     # only the latest
    ([crash(1.0)], 0, []),
])
def test_the_timeline_is_the_latest_exits_newest_first(records, limit, times):
    assert [e["time"] for e in timeline(records, limit)] == times


def test_a_timeline_entry_says_what_the_page_shows_and_no_more():
    record = crash(5.0, "sigkill", signal="SIGKILL", model="demo-a", request_id="r1", uptime_s=9.5,
                   stderr_tail="Traceback: the prompt was ...", memory={"rss_bytes": 1}, restart_in_s=0.0)
    stop = crash(6.0, "clean_stop", exit_code=0)
    assert timeline([record, stop]) == [
        {"time": 6.0, "class": "clean_stop", "crash": False, "signal": None, "exit_code": 0, "model": None,
         "request_id": None, "uptime_s": None, "restart_in_s": None, "degraded": False},
        {"time": 5.0, "class": "sigkill", "crash": True, "signal": "SIGKILL", "exit_code": None, "model": "demo-a",
         "request_id": "r1", "uptime_s": 9.5, "restart_in_s": 0.0, "degraded": False}]


def test_the_document_holds_status_journal_models_and_history():
    status = StatusReport(time=100.0, home="/h", overall="healthy", supervisord=SupervisordState(running=True, pid=1),
                          engine=EngineProbe(url="http://e/health", http_status=200,
                                             health=EngineHealth(status="ok", resident_model="demo-a")))
    row = ModelRow("demo-a", ["default"], "/m", True, 10, 20, True, "fits", "loaded")
    doc = page_document(status, [crash(50.0)], [row], 1000, [Point(95.0, running=1)], 5.0)
    assert doc["time"] == 100.0 and doc["status"] == status.to_json()
    assert [e["time"] for e in doc["journal"]] == [50.0]
    assert doc["models"] == {"budget_bytes": 1000, "models": [{
        "id": "demo-a", "aliases": ["default"], "source": "/m", "on_disk": True, "disk_bytes": 10,
        "estimate_bytes": 20, "fits": True, "verdict": "fits", "state": "loaded", "kind": "chat"}]}
    assert doc["history"]["interval_s"] == 5.0 and doc["history"]["span_s"] == 3600.0
    assert doc["history"]["points"] == [Point(95.0, running=1).to_json()]
