"""`mlxd status`'s engine line: what is running, as a table of cases."""

from __future__ import annotations

import pytest

from mlxd.cli.operate import format_running


@pytest.mark.parametrize("health, shown", [
    ({"in_flight": "abc"}, "in flight abc"),                                  # an engine from before batching
    ({"in_flight": None}, "in flight -"),
    ({"running": [], "max_concurrency": 1}, "in flight -"),                   # single concurrency
    ({"running": ["abc"], "max_concurrency": 1}, "in flight abc"),
    ({"running": [], "max_concurrency": 4}, "batch 0/4"),
    ({"running": ["a", "b"], "max_concurrency": 4}, "batch 2/4 (a, b)"),
    ({"running": list("abcdef"), "max_concurrency": 8}, "batch 6/8 (a, b, c, d, +2)"),
])
def test_format_running(health, shown):
    assert format_running(health) == shown
