"""bench/mlx_lm_floors.py (agents_load's floors, mlx-lm alone): its pure parts,
and the three floors run by run_floors on demo model a, each in its own process."""

from __future__ import annotations

import pytest

from testkit import load_bench

floors = load_bench("mlx_lm_floors")


@pytest.mark.parametrize("rows, expected", [
    ([[1, 2, 3, 4], [5, 6]], [[1, 2, 3], [5, 6, 5]]),       # mean 3: the long row cut, the short one its own tokens again
    ([[1], [2, 3, 4, 5, 6, 7, 8]], [[1, 1, 1, 1], [2, 3, 4, 5]]),
    ([[9, 9], [8, 8]], [[9, 9], [8, 8]]),
])
def test_equal_rows_are_cut_or_padded_to_the_mean(rows, expected):
    assert floors.equalize(rows) == expected


def test_common_prefix():
    assert floors.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert floors.common_prefix([1, 2], [1, 2, 3]) == 2
    assert floors.common_prefix([], [1]) == 0


def test_summary_counts_turns_a_minute_from_the_first_start_to_the_last_end():
    turns = [dict(agent=a, turn=n, t0=10.0 * (n - 1), ttft_s=0.5 * n, end_s=10.0 * n, prompt_tokens=100,
                  prefilled_tokens=40, completion_tokens=8) for a in range(2) for n in (1, 2, 3)]
    s = floors.summarize(turns)
    assert s["turns_per_minute"] == pytest.approx(60 * 6 / 30)
    assert s["ttft_s_p50_by_turn"] == {1: 0.5, 2: 1.0, 3: 1.5} and s["ttft_s_p50_turns_2_on"] == 1.25
    assert s["prefilled_tokens"] == 240


def test_the_floors_keep_each_conversation_and_prefill_only_what_is_new(demo_models, tmp_path):
    systems = [f"You are agent {i}. " + "Read the files, then fix the failing test. " * 12 for i in range(2)]
    turns = [[f"Turn {n} of agent {i}: the tool printed " + "ok " * (10 + 3 * i) for n in range(2)] for i in range(2)]
    spec = {"model": str(demo_models.a), "systems": systems, "user_turns": turns, "max_tokens": 4,
            "shared_prefix": False}
    got = floors.run_floors(list(floors.FLOORS), spec, tmp_path / "distinct", 300)
    assert list(got) == ["plain", "batch", "serial"]
    for name, doc in got.items():
        assert doc["status"] == "ok", doc.get("error")
        assert doc["summary"]["turns_completed"] == 4 and doc["summary"]["turns_per_minute"] > 0
        assert doc["memory"]["rss_peak_bytes"] > 0  # polled from outside, the floor's own process
        by = {(t["agent"], t["turn"]): t for t in doc["turns"]}
        shortest = min(by[a, 1]["prompt_tokens"] for a in range(2))
        for a in range(2):
            first, second = by[a, 1], by[a, 2]
            assert first["cached_tokens"] == 0 and 0 < first["completion_tokens"] <= 4
            # turn 2 reuses turn 1's KV: its prompt at least (equal rows: up to the first cut or pad)
            assert second["cached_tokens"] >= (shortest if name == "plain" else first["prompt_tokens"])
            if name != "plain":
                assert second["prefilled_tokens"] == second["prompt_tokens"] - second["cached_tokens"]
        if name == "plain":  # equal rows: every row prefilled the same count each turn
            assert by[0, 2]["prefilled_tokens"] == by[1, 2]["prefilled_tokens"]
    # the rows' real, unequal lengths: the same prompts as one row at a time
    assert [t["prompt_tokens"] for t in got["batch"]["turns"] if t["turn"] == 1] == \
        [t["prompt_tokens"] for t in got["serial"]["turns"] if t["turn"] == 1]
    shared = floors.run_floors(["serial"], {**spec, "systems": [systems[0]] * 2, "shared_prefix": True},
                               tmp_path / "shared", 300)["serial"]
    by = {(t["agent"], t["turn"]): t for t in shared["turns"]}
    assert by[0, 1]["cached_tokens"] == 0 and by[1, 1]["cached_tokens"] > 0.8 * by[1, 1]["prompt_tokens"] - 40
