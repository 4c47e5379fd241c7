"""The status page's history (gateway/status_history.py), its pure parts as
tables: tok/s from the generated-tokens counter (restarts and gaps
included), the request counts, one /health answer as a point, the hour's
window."""

from __future__ import annotations

import pytest

from mlxd.gateway.status_history import Counted, Point, point_from, request_counts, tokens_per_s, within
from mlxd.reports import EngineHealth, EngineMemory, HeldRequestReport, PromptCacheReport

MIB = 2**20


@pytest.mark.parametrize("last, now, rate", [
    (None, Counted(10.0, 1, 500), None),                          # the first reading: nothing to compare with
    (Counted(5.0, 1, 100), None, None),                           # the engine did not answer
    (Counted(5.0, 1, 100), Counted(10.0, 1, 600), 100.0),         # 500 tokens in 5 s
    (Counted(5.0, 1, 100), Counted(10.0, 1, 100), 0.0),           # idle
    (Counted(5.0, 1, 100), Counted(5.0, 1, 300), None),           # no time between: no rate
    (Counted(5.0, 1, 900), Counted(10.0, 2, 50), 10.0),           # restarted: the new engine's 50 are all new
    (Counted(5.0, 1, 900), Counted(10.0, 1, 50), 10.0),           # a counter that went back started again
    (Counted(0.0, 1, 100), Counted(60.0, 1, 700), 10.0),          # across a gap of failed reads: the mean over it
    (Counted(0.0, None, 0), Counted(3.0, None, 10), 3.33),        # an engine that names no pid
])
def test_tokens_per_s(last, now, rate):
    assert tokens_per_s(last, now) == rate


def held(*statuses: str) -> list[HeldRequestReport]:
    return [HeldRequestReport(id=f"r{i}", status=s) for i, s in enumerate(statuses)]


@pytest.mark.parametrize("health, counts", [
    (EngineHealth(status="ok", running=[], queue_depth=0), (0, 0)),
    (EngineHealth(status="ok", running=["r0"], requests=held("decoding"), queue_depth=0), (1, 0)),
    (EngineHealth(status="ok", running=["r0", "r1"], requests=held("prefilling", "decoding", "waiting"),
                  queue_depth=2), (2, 3)),                       # waiting for room in the batch counts as queued
    (EngineHealth(status="ok", running=None, in_flight="r0", queue_depth=1), (1, 1)),  # an engine from before batching
    (EngineHealth(status="loading", running=None, queue_depth=None), (0, 0)),
])
def test_request_counts(health, counts):
    assert request_counts(health) == counts


HEALTH = EngineHealth(status="ok", pid=7, running=["r0"], requests=held("decoding", "waiting"), queue_depth=1,
                      memory=EngineMemory(mlx_active_bytes=300 * MIB, mlx_cache_bytes=20 * MIB, rss_bytes=500 * MIB),
                      prompt_cache=PromptCacheReport(enabled=True, memory_bytes=64 * MIB),
                      counters={"generated_tokens": 1000})


@pytest.mark.parametrize("t, health, last, point, counted", [
    # no answer: a point without figures (a gap), and the last reading kept for the next rate
    (20.0, None, Counted(10.0, 7, 400), Point(20.0), Counted(10.0, 7, 400)),
    (20.0, HEALTH, Counted(10.0, 7, 400),
     Point(20.0, rss_bytes=500 * MIB, mlx_active_bytes=300 * MIB, mlx_cache_bytes=20 * MIB,
           prompt_cache_bytes=64 * MIB, running=1, queued=2, tok_s=60.0), Counted(20.0, 7, 1000)),
    (20.0, HEALTH, None,
     Point(20.0, rss_bytes=500 * MIB, mlx_active_bytes=300 * MIB, mlx_cache_bytes=20 * MIB,
           prompt_cache_bytes=64 * MIB, running=1, queued=2), Counted(20.0, 7, 1000)),
    # still loading: no memory figures yet, no counter, the cache off
    (20.0, EngineHealth(status="loading", running=[], queue_depth=0, prompt_cache=PromptCacheReport(enabled=False)),
     Counted(10.0, 7, 400), Point(20.0, running=0, queued=0), Counted(10.0, 7, 400)),
])
def test_a_point_from_one_health_answer(t, health, last, point, counted):
    assert point_from(t, health, last) == (point, counted)


def test_device_memory_is_kept_where_the_engine_reports_it():
    health = EngineHealth(status="ok", memory=EngineMemory(rss_bytes=MIB, device_process_bytes=900 * MIB))
    assert point_from(1.0, health, None)[0].device_bytes == 900 * MIB


@pytest.mark.parametrize("times, now, span, kept", [
    ([], 100.0, 60.0, []),
    ([10.0, 50.0, 90.0, 100.0], 100.0, 60.0, [50.0, 90.0, 100.0]),   # the edge is in
    ([10.0, 20.0], 100.0, 60.0, []),                                 # all older than the span
    ([90.0, 110.0], 100.0, 60.0, [90.0]),                            # a clock that went back: not the future
])
def test_the_window_keeps_the_last_span(times, now, span, kept):
    assert [p.t for p in within([Point(t) for t in times], now, span)] == kept
