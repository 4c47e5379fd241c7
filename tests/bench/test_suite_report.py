"""The benchmark suite's pure parts (bench/run.py, bench/recovery.py), as
tables: the headline figures taken from each benchmark's JSON, the goal
verdicts, and how a request's outcome is counted. The benchmarks themselves
are run by hand (bench/README.md); this keeps the report from rotting when a
benchmark's JSON changes."""

from __future__ import annotations


import pytest

from testkit import load_bench

suite = load_bench("run")
recovery = load_bench("recovery")


def _engine_doc(engine_tok_s: float) -> dict:
    way = lambda tok, ttft: {"decode_tok_s_median": tok, "ttft_ms_median": ttft,  # noqa: E731
                             "decode_ratio_vs_inproc": tok / 500.0, "ttft_ratio_vs_inproc": ttft / 40.0}
    return {"settings": {"goal_ratio": 0.97},
            "results": {"demo-a": {"summary": {"inproc": way(500.0, 40.0), "engine": way(engine_tok_s, 44.0),
                                               "mlx_lm": way(400.0, 45.0)}}}}


@pytest.mark.parametrize("engine_tok_s, met", [(495.0, True), (485.0, True), (484.0, False), (300.0, False)])
def test_engine_figure_meets_the_goal_only_at_097_of_in_process(engine_tok_s, met):
    figs = suite.engine_figures(_engine_doc(engine_tok_s))
    engine = next(f for f in figs if f.what == "decode tok/s, mlxd engine")
    assert engine.ratio == pytest.approx(engine_tok_s / 500.0) and engine.anchor_value == 500.0
    assert engine.met is met
    assert next(f for f in figs if f.what == "decode tok/s, mlx_lm.server").met is None  # a comparison, no goal


@pytest.mark.parametrize("gw_tok_s, gw_ttft, met", [
    (500.0, 44.0, (True, True)), (449.0, 44.0, (False, True)), (500.0, 45.1, (True, False))])
def test_gateway_figures_check_throughput_and_extra_ttft(gw_tok_s, gw_ttft, met):
    doc = {"settings": {"goal_ratio": 0.9, "goal_ttft_ms": 5.0},
           "results": {"model": "demo-a", "ready": {"median": {"ready": 5.0, "engine": 1.5}},
                       "summary": {"stream": {"direct": {"decode_tok_s_median": 500.0, "ttft_ms_median": 40.0},
                                              "gateway": {"decode_tok_s_median": gw_tok_s,
                                                          "ttft_ms_median": gw_ttft}}}}}
    throughput, ttft, ready = suite.gateway_figures(doc)
    assert (throughput.met, ttft.met) == met
    assert ready.benchmark == "cold start" and ready.value == 5.0


@pytest.mark.parametrize("outcomes, expected", [
    ([("ok", "engine"), ("complete", "ollama"), ("stream_error", "engine")],
     {"sent": 3, "answered_by_engine": 1, "answered_by_ollama": 1, "stream_cut_explicit": 1}),
    ([("failed", None), ("silent_truncation", "engine"), ("ok", "engine")],
     {"sent": 3, "answered_by_engine": 1, "failed": 2, "failed_failed": 1, "failed_silent_truncation": 1}),
    ([], {"sent": 0}),
])
def test_recovery_counts_every_request_once(outcomes, expected):
    assert recovery.outcome_counts([{"outcome": o, "backend": b} for o, b in outcomes]) == expected


@pytest.mark.parametrize("failed, total_s, met", [(0, 1.5, (True, True)), (1, 1.5, (False, True)),
                                                  (0, 2.6, (True, False))])
def test_recovery_goals_zero_failed_and_at_most_a_second_over_the_weights(failed, total_s, met):
    arm = {"crashes": [{}] * 10, "total_minus_weights_s": total_s - 1.2,
           "median": {"total_s": total_s, "load_s": 1.3, "weights_s": 1.2, "detection_s": 0.05, "backoff_s": 0.0,
                      "spawn_s": 0.06},
           "requests": {"sent": 100, "failed": failed, "answered_by_engine": 60, "answered_by_ollama": 40 - failed}}
    figs = suite.recovery_figures({"settings": {"model": "demo-a"}, "arms": {"standby": arm, "afresh": arm}})
    for name in ("standby", "afresh"):
        mine = [f for f in figs if f.benchmark == f"recovery ({name})"]
        total = mine[0]
        failed_fig = next(f for f in mine if f.what.startswith("requests failed"))
        assert (failed_fig.met, total.met) == met


@pytest.mark.parametrize("peak_ratio, met", [(1.04, True), (1.06, False)])
def test_swap_peak_goal_and_markdown_marks_misses(peak_ratio, met):
    mib = 2**20
    doc = {"cold": {"a": {"load_s": 0.1, "peak_bytes": 100 * mib, "active_bytes": 90 * mib},
                    "b": {"load_s": 0.2, "peak_bytes": 200 * mib, "active_bytes": 190 * mib}},
           "swaps": [{"to": "b", "unload_s": 0.05, "load_s": 0.2, "peak_bytes": int(200 * mib * peak_ratio),
                      "active_bytes": 190 * mib},
                     {"to": "a", "unload_s": 0.05, "load_s": 0.1, "peak_bytes": 100 * mib, "active_bytes": 95 * mib}],
           "peak_ratio": peak_ratio, "rss_growth_bytes": 0}
    figs = suite.swap_figures(doc, ("demo-a", "demo-b"))
    peak = next(f for f in figs if f.what.startswith("peak memory"))
    assert peak.met is met
    steady = {f.model: f.ratio for f in figs if f.what.startswith("steady memory")}
    assert steady == {"demo-a": pytest.approx(95 / 90), "demo-b": pytest.approx(1.0)}
    info = {"date": "today", "platform": "p", "cpu_count": 2, "cpu": "c", "python": "3", "mlx": "m",
            "mlx_device": "cpu", "mlx_lm": "l", "git": {"commit": "abc"}}
    md = suite.markdown(figs, info, {"quick": True}, ["reuse: boom"])
    assert ("❌" in md) is (not met) and "not measured:** reuse: boom" in md


prompt_cache = load_bench("prompt_cache")


def _turns(arm: str, ttft_ms: list[float], prompt: int = 1000, cached_from_2: float = 0.97, decode: float = 100.0):
    return [{"turn": t, "ttft_s": ms / 1000, "prompt_tokens": prompt + 50 * t, "decode_tok_s": decode,
             "cached_tokens": 0 if t == 1 or arm == "nocache" else int(cached_from_2 * (prompt + 50 * t))}
            for t, ms in enumerate(ttft_ms, start=1)]


@pytest.mark.parametrize("crash_turn6_ms, cached, met", [
    (200.0, 0.97, (True, True, True)),  # from disk: 0.2x cold
    (900.0, 0.97, (True, False, True)),  # disk slower than the goal
    (200.0, 0.90, (False, True, True)),  # too little reused
])
def test_prompt_cache_summary_and_figures(crash_turn6_ms, cached, met):
    import json

    cold = [1000.0] * 7
    rows = {"cache": _turns("cache", [1000, 40, 40, 40, 40, 40, 40], cached_from_2=cached),
            "nocache": _turns("nocache", cold),
            "mlx_lm": _turns("mlx_lm", [1000, 80, 80, 80, 80, 80, 80]),
            "crash": _turns("crash", [1000, 40, 40, 40, 40, crash_turn6_ms, 40])}
    summary = prompt_cache.summarize(rows, {})
    assert summary["median_cache_over_cold_from_turn_2"] == pytest.approx(0.04)
    assert summary["cache_over_mlx_lm_from_turn_2"] == pytest.approx(0.5)
    assert summary["after_crash_over_cold"] == pytest.approx(crash_turn6_ms / 1000)
    doc = json.loads(json.dumps({"summary": summary, "settings": {"turns": 7}}))  # as read back from disk
    figs = {f.what: f for f in suite.cache_figures(doc, "demo-a")}
    reused = figs["prompt tokens reused, turns 2+ (lowest)"]
    crash = figs["TTFT of the turn after a SIGABRT (from disk)"]
    vs_mlx = figs["turn-N TTFT vs mlx_lm.server's (median, turns 2+)"]
    assert (reused.met, crash.met, vs_mlx.met) == met
    assert figs["turn-7 TTFT with the cache"].ratio == pytest.approx(0.04)


@pytest.mark.parametrize("load_s, timings, parts", [
    (3.5, {"start_to_worker_s": 1.0, "mlx_lm_import_s": 0.5, "prompt_cache_index_s": 0.25, "last_load_s": 1.5},
     {"start_s": 1.0, "mlx_lm_s": 0.5, "index_s": 0.25, "weights_s": 1.5, "rest_s": 0.25}),
    (2.0, {}, {"start_s": 0.0, "mlx_lm_s": 0.0, "index_s": 0.0, "weights_s": 0.0, "rest_s": 2.0}),  # an older engine
])
def test_recovery_splits_the_load_by_the_engines_timings(load_s, timings, parts):
    assert recovery.load_parts(load_s, timings) == pytest.approx(parts)
