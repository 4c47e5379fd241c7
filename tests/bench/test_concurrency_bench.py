"""bench/concurrency.py's pure parts, as tables: percentiles, the aggregate
throughput of a round, the single-mode gap between queued requests, the
distinct prompts, the plan, nvidia-smi's output, the goals and the table.
No server is started (the benchmark itself is run by hand)."""

from __future__ import annotations

import itertools
import math
import os

import pytest

from testkit import load_bench

cb = load_bench("concurrency")
Req = cb.Req


def req(t0, t_first, t_end, tokens=10, client=0, prompt=100):
    return Req(client, t0, t_first, t_end, tokens, prompt)


# --- percentiles -------------------------------------------------------------------------------

@pytest.mark.parametrize("values, q, expected", [
    ([], 0.5, None),
    ([None, math.nan], 0.5, None),
    ([7.0], 0.5, 7.0),
    ([7.0], 0.95, 7.0),
    ([3.0, 1.0, 2.0], 0.5, 2.0),
    ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5),
    ([1.0, 2.0, 3.0, 4.0], 0.0, 1.0),
    ([1.0, 2.0, 3.0, 4.0], 1.0, 4.0),
    (list(range(1, 21)), 0.95, 19.05),  # rank 18.05 of 0..19
    ([10.0, None, 20.0], 0.5, 15.0),  # a request without a first token is left out
])
def test_pctl(values, q, expected):
    got = cb.pctl(values, q)
    assert got == pytest.approx(expected) if expected is not None else got is None


# --- aggregate throughput ------------------------------------------------------------------------

@pytest.mark.parametrize("reqs, expected", [
    ([], None),
    ([req(0.0, 0.1, 1.0, tokens=100)], 100.0),
    # two at once: all tokens over first sent -> last end
    ([req(0.0, 0.1, 2.0, tokens=100), req(0.01, 0.2, 1.0, tokens=100)], 100.0),
    # staggered starts: the window opens at the earliest send
    ([req(1.0, 1.1, 2.0, tokens=50), req(0.0, 0.5, 1.5, tokens=50)], 50.0),
    # tokens actually generated count, not max_tokens
    ([req(0.0, 0.1, 1.0, tokens=30), req(0.0, 0.1, 1.0, tokens=10)], 40.0),
    ([req(1.0, 1.0, 1.0, tokens=5)], None),  # no time passed
])
def test_aggregate_tok_s(reqs, expected):
    got = cb.aggregate_tok_s(reqs)
    assert got == pytest.approx(expected) if expected is not None else got is None


# --- the gap between queued requests ----------------------------------------------------------------

@pytest.mark.parametrize("reqs, lone, expected", [
    ([], 0.1, []),
    ([req(0.0, 0.1, 1.0)], 0.1, []),  # nothing queued
    # served one after another: 2nd first token 0.12 s after the 1st ended, lone TTFT 0.1 -> 20 ms
    ([req(0.0, 0.1, 1.0), req(0.0, 1.12, 2.0)], 0.1, [0.02]),
    # the order is the order of first tokens, not of the client numbers or the list
    ([req(0.0, 2.205, 3.0, client=0), req(0.0, 0.1, 1.0, client=1), req(0.0, 1.11, 2.0, client=2)], 0.1,
     [0.01, 0.105]),
    # a queued request faster than a lone one (it was tokenized while it waited): negative
    ([req(0.0, 0.1, 1.0), req(0.0, 1.05, 2.0)], 0.1, [-0.05]),
    # a request that never produced a content chunk is skipped
    ([req(0.0, 0.1, 1.0), req(0.0, None, 1.5), req(0.0, 1.1, 2.0)], 0.1, [0.0]),
])
def test_queue_gaps(reqs, lone, expected):
    assert cb.queue_gaps(reqs, lone) == pytest.approx(expected)


def test_gap_summary_takes_the_lone_ttft_from_the_one_client_rounds():
    rounds = {1: [[req(0.0, 0.10, 1.0)], [req(0.0, 0.12, 1.0)], [req(0.0, 0.11, 1.0)]],  # lone TTFT 110 ms
              2: [[req(0.0, 0.11, 1.0), req(0.0, 1.13, 2.0)]],  # gap 20 ms
              4: [[req(0.0, 0.11, 1.0), req(0.0, 1.12, 2.0), req(0.0, 2.14, 3.0), req(0.0, 3.11, 4.0)]]}  # 10, 30, 0
    g = cb.gap_summary(rounds)
    assert g["lone_ttft_ms"] == pytest.approx(110.0)
    assert g["n"] == 4
    assert g["p50_ms"] == pytest.approx(15.0) and g["max_ms"] == pytest.approx(30.0)
    assert g["min_ms"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("rounds", [{}, {2: [[req(0.0, 0.1, 1.0), req(0.0, 1.1, 2.0)]]},
                                    {1: [[req(0.0, 0.1, 1.0)]]}])
def test_gap_summary_needs_one_and_more_clients(rounds):
    assert cb.gap_summary(rounds) is None


# --- the prompts ------------------------------------------------------------------------------------

def words(text: str) -> int:
    return len(text.split())


def chars4(text: str) -> int:
    return max(1, len(text) // 4)


@pytest.mark.parametrize("count", [words, chars4])
@pytest.mark.parametrize("n", [1, 7, 200, 1000])
def test_make_prompt_fits_the_token_count(count, n):
    text = cb.make_prompt(3, n, count)
    assert count(text) <= n or words(text) == 1
    assert count(text) >= n - (3 if count is chars4 else 0)  # one more word would overshoot
    assert cb.make_prompt(3, n, count) == text  # deterministic: every arm gets the same prompts


def test_prompts_of_a_run_are_distinct_from_their_first_word_on():
    steps = cb.plan([1, 2, 4, 8], rounds=3, warmup=1)
    ks = [0] + [k for s in steps for k in s.ks]
    texts = {k: cb.make_prompt(k, 200, words) for k in ks}
    firsts = [t.split()[0] for t in texts.values()]
    assert len(set(firsts)) == len(firsts)
    for a, b in itertools.combinations(texts.values(), 2):
        assert len(os.path.commonprefix([a, b])) <= 4, (a[:20], b[:20])
    # prompts of one round start with different letters
    for s in steps:
        initials = [texts[k][0] for k in s.ks]
        assert len(set(initials)) == len(initials)


@pytest.mark.parametrize("k, lead", [(0, "Ba"), (1, "Ce"), (20, "Zo"), (21, "Bace"), (22, "Cece"),
                                     (21 * 21, "Babace")])
def test_lead_word(k, lead):
    assert cb.lead_word(k) == lead


# --- the plan ------------------------------------------------------------------------------------------

def test_plan_orders_client_counts_warmups_first_and_numbers_every_request():
    steps = cb.plan([1, 2, 4], rounds=2, warmup=1)
    assert [(s.clients, s.warmup, s.round) for s in steps] == [
        (1, True, 0), (1, False, 0), (1, False, 1),
        (2, True, 0), (2, False, 0), (2, False, 1),
        (4, True, 0), (4, False, 0), (4, False, 1)]
    ks = [k for s in steps for k in s.ks]
    assert ks == list(range(1, 1 + 3 * (1 + 2 + 4)))  # 0 is the connection warm-up's
    assert all(len(s.ks) == s.clients for s in steps)


def test_plan_without_warmup():
    assert [s.warmup for s in cb.plan([8], rounds=2, warmup=0)] == [False, False]


# --- summary, goals, table -------------------------------------------------------------------------------

def block(agg, ttft_ms, mem=None):
    return {"agg_tok_s_median": agg, "agg_tok_s_rounds": [agg], "ttft_ms_p50": ttft_ms, "ttft_ms_p95": ttft_ms * 1.5,
            "ttft_ms_max": ttft_ms * 2, "completion_tokens_min": 256, "completion_tokens_max": 256,
            "prompt_tokens_min": 1010, "prompt_tokens_max": 1013, "cached_tokens_max": 0, "memory": mem}


def test_summarize_block():
    rounds = [[req(0.0, 0.1, 1.0, tokens=100), req(0.0, 0.3, 2.0, tokens=100)],
              [req(0.0, 0.2, 1.0, tokens=100), req(0.0, 0.4, 1.0, tokens=100)]]
    s = cb.summarize_block(rounds)
    assert s["rounds"] == 2
    assert s["agg_tok_s_rounds"] == pytest.approx([100.0, 200.0]) and s["agg_tok_s_median"] == pytest.approx(150.0)
    assert s["ttft_ms_p50"] == pytest.approx(250.0) and s["ttft_ms_max"] == pytest.approx(400.0)
    assert s["completion_tokens_min"] == s["completion_tokens_max"] == 100


@pytest.mark.parametrize("mem, expected", [
    (None, (None, None)),
    ({}, (None, None)),
    ({"rss_peak_bytes": 5}, (5, "RSS")),
    ({"rss_peak_bytes": 5, "gpu_peak_bytes": 9, "gpu_source": "GPU, nvidia-smi per process"},
     (9, "GPU, nvidia-smi per process")),
])
def test_headline_memory_prefers_the_gpu(mem, expected):
    assert cb.headline_memory(mem) == expected


def verdicts(blocks, gaps=None):
    return {g["goal"]: g["met"] for g in cb.goals(blocks, gaps)}


def test_goals_all_met():
    gib = 1024 ** 3
    blocks = {
        "single": {1: block(100.0, 50.0, {"rss_peak_bytes": 9 * gib, "mlx_peak_bytes": 8 * gib,
                                          "budget_bytes": 40 * gib})},
        "batched": {1: block(98.0, 50.0), 4: block(300.0, 60.0), 8: block(500.0, 80.0, {
            "rss_peak_bytes": 1, "gpu_peak_bytes": 17 * gib, "gpu_source": "g", "mlx_peak_bytes": 18 * gib,
            "budget_bytes": 40 * gib})},
        "mlx_lm": {4: block(250.0, 70.0), 8: block(400.0, 90.0, {"gpu_peak_bytes": 20 * gib, "gpu_source": "g"})},
    }
    v = verdicts(blocks, {"p50_ms": 5.0, "p95_ms": 9.0, "max_ms": 12.0, "n": 4, "lone_ttft_ms": 50.0})
    assert all(v.values()), v
    assert len(v) == 4 + 1 + 2 + 1 + 1  # per 4/8: aggregate and TTFT; one client; two budgets; memory; gap


def test_goals_missed_and_not_measured():
    blocks = {"batched": {1: block(90.0, 50.0), 4: block(260.0, 80.0), 8: block(500.0, 80.0)},
              "single": {1: block(100.0, 50.0)},
              "mlx_lm": {4: block(250.0, 70.0), 8: block(400.0, 90.0)}}
    v = verdicts(blocks, {"p50_ms": 25.0, "p95_ms": 30.0, "max_ms": 40.0, "n": 2, "lone_ttft_ms": 50.0})
    assert v["batched aggregate ≥ 1.10× mlx_lm.server at 4 clients"] is False  # 1.04×
    assert v["batched TTFT p50 ≤ mlx_lm.server's at 4 clients"] is False
    assert v["batched aggregate ≥ 1.10× mlx_lm.server at 8 clients"] is True  # 1.25×
    assert v["one client: batched ≥ 0.97× single"] is False  # 0.90×
    assert v["batched peak memory ≤ mlx_lm.server's at 8 clients"] is None  # no memory figures
    assert v["single: gap between queued requests beyond a lone TTFT ≤ 20 ms (median)"] is False
    only = verdicts({"single": {1: block(100.0, 50.0)}})
    assert set(only.values()) == {None}


def test_markdown_renders_every_block_and_goal():
    blocks = {"single": {1: block(100.0, 50.0), 2: block(101.0, 120.0)},
              "mlx_lm": {1: block(80.0, 60.0), 2: block(150.0, 70.0, {"rss_peak_bytes": 300 * cb.MIB})}}
    gaps = {"p50_ms": 5.0, "p95_ms": 9.0, "max_ms": 12.0, "n": 4, "lone_ttft_ms": 50.0}
    doc = {"machine": {"date": "d", "cpu_count": 2, "cpu": "EPYC", "gpu": None, "platform": "Linux", "mlx": "0.32",
                       "mlx_device": "cpu", "mlx_lm": "0.32.2", "python": "3.11"},
           "settings": {"model": "demo-a", "max_tokens": 256, "prompt_tokens": 1000, "rounds": 3, "warmup": 1,
                        "batch_size": 8, "prompt_cache": True, "memory_sources": "RSS"},
           "results": {"blocks": blocks, "single_gaps": gaps, "goals": cb.goals(blocks, gaps), "errors": {},
                       "notes": []}}
    md = cb.markdown(doc)
    rows = [line for line in md.splitlines() if line.startswith("| mlxd single |") or line.startswith("| mlx_lm")]
    assert len(rows) == 4
    assert "| mlxd single | 1 | 100.0 | **1.250** |" in md
    assert "300 MiB (RSS)" in md and "2 CPUs (EPYC)" in md
    assert "p50 5.0 ms" in md and "MET" in md


def test_engine_toml_adds_the_arm_s_lines_to_the_engine_table(tmp_path):
    import tomllib

    cfg = tomllib.loads(cb.engine_toml(tmp_path, {"max_concurrency": 8}, prompt_cache=False, max_queue=16))
    assert cfg["engine"]["max_concurrency"] == 8 and cfg["engine"]["max_queue"] == 16
    assert cfg["engine"]["prompt_cache"] == {"enabled": False}
    assert cfg["aliases"]["default"] == "bench"
    plain = tomllib.loads(cb.engine_toml(tmp_path, {}, prompt_cache=True, max_queue=8))
    assert "max_concurrency" not in plain["engine"] and "prompt_cache" not in plain["engine"]
