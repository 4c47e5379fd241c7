"""The one-model cache: switching unloads first, memory comes back, and
repeated switches do not grow the process."""

from __future__ import annotations

import pytest

from mlxd.memory_estimate import read_weight_bytes
from testkit import chat, metric, wait_until

pytestmark = pytest.mark.timeout(300)
MIB = 2**20


def test_switch_unloads_first_and_memory_returns_to_the_pre_load_level(start_engine, demo_models):
    eng = start_engine()
    weights_a = read_weight_bytes(demo_models.a)[0]
    weights_b = read_weight_bytes(demo_models.b)[0]
    h = eng.health()
    assert h["resident_model"] == "demo-a"  # the default model is preloaded
    baseline = h["memory"]["mlx_active_before_first_load"]
    assert h["memory"]["mlx_active_bytes"] - baseline == pytest.approx(weights_a, rel=0.05)

    assert chat(eng.url, model="second").status_code == 200
    h = eng.health()
    mem = h["memory"]
    assert h["resident_model"] == "demo-b"
    # After the unload, MLX's active memory is back at the level before any load ...
    assert abs(mem["mlx_active_after_last_unload"] - baseline) < 1 * MIB
    # ... and from then on the peak covers model b (and one short generation) only:
    # the two models were never resident together.
    assert mem["mlx_peak_bytes"] < weights_a + weights_b
    assert mem["mlx_active_bytes"] - baseline == pytest.approx(weights_b, rel=0.05)
    assert metric(eng.url, "mlxd_engine_model_unloads") == 1
    # MLX's buffer cache is bounded by the budget too: its allocator frees cached buffers before active +
    # cached memory would pass it (left at MLX's default, 95 % of a CUDA card, the cache grew past the budget)
    assert mem["mlx_memory_limit_bytes"] == mem["budget_bytes"] > 0


def test_twenty_alternating_switches_do_not_grow_rss(start_engine):
    eng = start_engine()
    models = ["demo-b", "demo-a"]
    for i in range(4):  # warm up allocator and caches
        assert chat(eng.url, model=models[i % 2], max_tokens=2).status_code == 200
    # Read once the prompt cache's writes are collected: an entry a switch evicted keeps its arrays until its
    # file is written (counted as the cache's writing_bytes), a moment longer on a loaded machine.
    settled = lambda: (lambda h: h if h["phase"] == "idle" and h["prompt_cache"]["disk_writes_pending"] == 0  # noqa: E731
                       else None)(eng.health())
    start = wait_until(settled, 30, what="the writes collected")
    rss_start, active_start = start["memory"]["rss_bytes"], start["memory"]["mlx_active_bytes"]
    for i in range(20):
        assert chat(eng.url, model=models[i % 2], max_tokens=2).status_code == 200
    wait_until(settled, 30, what="the writes collected")
    # Nothing of the 20 switches stays behind (the memory figure is sampled while idle, every second).
    h = wait_until(lambda: (lambda h: h if h["memory"]["mlx_active_bytes"] <= active_start + 1 * MIB else None)(
        eng.health()), 10, what="MLX's active memory back to where it was")
    assert h["counters"]["model_loads"] == 1 + 4 + 20
    growth = h["memory"]["rss_bytes"] - rss_start
    assert growth < 40 * MIB, f"RSS grew by {growth / MIB:.1f} MiB over 20 switches"
