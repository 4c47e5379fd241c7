"""`mlxd status`'s engine line: the model and what is running, as tables of cases."""

from __future__ import annotations

import pytest

from mlxd import default_model
from mlxd.cli.status_format import format_model, format_running
from mlxd.reports import EngineHealth


@pytest.mark.parametrize("health, shown", [
    ({"in_flight": "abc"}, "in flight abc"),                                  # an engine from before batching
    ({"in_flight": None}, "in flight -"),
    ({"running": [], "max_concurrency": 1}, "in flight -"),                   # single concurrency
    ({"running": ["abc"], "max_concurrency": 1}, "in flight abc"),
    ({"running": [], "max_concurrency": 4}, "batch 0/4"),
    ({"running": ["a", "b"], "max_concurrency": 4}, "batch 2/4 (a, b)"),
    ({"running": list("abcdef"), "max_concurrency": 8}, "batch 6/8 (a, b, c, d, +2)"),
])
def test_format_running(health, shown):  # `health`: the /health body's keys
    assert format_running(EngineHealth.from_json({"status": "ok", **health})) == shown


@pytest.mark.parametrize("health, shown", [
    ({}, "-"),
    ({"resident_model": "qwen"}, "qwen"),
    ({"resident_model": "qwen", "kv_cache": {"bits": 16, "group_size": 64, "quantized_start": 0}}, "qwen"),
    ({"resident_model": "qwen", "kv_cache": {"bits": 8, "group_size": 64, "quantized_start": 0}}, "qwen (KV 8-bit)"),
    ({"resident_model": "qwen", "tools": "template"}, "qwen"),
    ({"resident_model": "smol", "tools": "mlxd"}, "smol (tools by mlxd)"),
    ({"resident_model": "smol", "tools": "mlxd", "kv_cache": {"bits": 4, "group_size": 64, "quantized_start": 0}},
     "smol (KV 4-bit, tools by mlxd)"),
    ({"resident_model": default_model.MODEL_ID, "kv_cache": None},
     f"{default_model.MODEL_ID} ({default_model.MODEL_NAME})"),
    # idle unload (engine/core/keep_alive.py): when it is due, and that it happened
    ({"resident_model": "qwen", "unload_in_s": 240.0}, "qwen (unloads if idle 4 min more)"),
    ({"resident_model": "qwen", "unload_in_s": 30.0, "tools": "mlxd"}, "qwen (tools by mlxd, unloads if idle 30 s more)"),
    ({"resident_model": None, "unloaded_idle_at": 1.0e9, "unloaded_idle_model": "qwen"},
     "- (idle: qwen unloaded at {at}; the next request loads it)"),
])
def test_format_model(health, shown):
    if "{at}" in shown:
        import time

        shown = shown.format(at=time.strftime("%H:%M", time.localtime(health["unloaded_idle_at"])))
    assert format_model(EngineHealth.from_json({"status": "ok", **health})) == shown
