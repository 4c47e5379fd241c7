"""The worker's request table: one status per request, in the order taken,
and the snapshot views /health, /metrics and the drain read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlxd.engine.core.request_table import RequestStatus, RequestTable
from mlxd.engine.core.worker_state import Phase, WorkerStatus

W, P, D = RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.DECODING


def job(i: str) -> SimpleNamespace:
    return SimpleNamespace(id=i, fingerprint="f" + i)


@pytest.mark.parametrize("steps, rows, running", [
    ([("hold", "a", P)], [("a", P)], ["a"]),
    ([("hold", "a", P), ("hold", "b", W)], [("a", P), ("b", W)], ["a"]),  # waiting is held, not running
    ([("hold", "a", P), ("hold", "b", P), ("hold", "a", D)], [("a", D), ("b", P)], ["a", "b"]),  # order kept
    ([("hold", "a", D), ("hold", "b", W), ("release", "a", None)], [("b", W)], []),
    ([("hold", "b", W), ("hold", "b", P), ("release", "c", None)], [("b", P)], ["b"]),  # releasing nothing: no-op
])
def test_one_status_per_request_in_the_order_taken(steps, rows, running):
    table, jobs = RequestTable(), {}
    for op, i, status in steps:
        j = jobs.setdefault(i, job(i))
        table.hold(j, status) if op == "hold" else table.release(j)
    held = table.rows()
    assert [(r.id, r.status) for r in held] == rows
    status = WorkerStatus(Phase.DECODE, "m", held)
    assert list(status.in_flight_ids) == running
    assert status.in_flight == (running[0] if running else None)
    assert status.in_flight_fingerprint == ("f" + running[0] if running else None)
    assert all(r.job is jobs[r.id] for r in held)  # the drain cancels the jobs themselves


def test_a_status_kept_keeps_its_since():
    table, a = RequestTable(), job("a")
    table.hold(a, P)
    since = table.rows()[0].since
    table.hold(a, P)
    assert table.rows()[0].since == since
