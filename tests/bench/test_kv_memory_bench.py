"""bench/kv_memory.py's pure parts, as tables (the run itself is by hand)."""

from __future__ import annotations

import pytest

from testkit import load_bench

km = load_bench("kv_memory")


@pytest.mark.parametrize("samples, growth", [
    ([100, 100, 100], 0.0),
    ([100, 101, 100], 0.01),
    ([100, 150, 200], 1.0),
    ([], 0.0),
])
def test_growth_after_first(samples, growth):
    assert km.growth_after_first(samples) == pytest.approx(growth)


@pytest.mark.parametrize("samples, jump, steps", [
    ([10, 10, 20, 20, 30], 5, 2),  # the staircase
    ([10, 11, 12, 13, 14], 5, 0),  # a slow creep is not a step
    ([30, 20, 10], 5, 0),  # memory given back is not a step
])
def test_steps_seen(samples, jump, steps):
    assert km.steps_seen(samples, jump) == steps


@pytest.mark.parametrize("budget, per_token, step, fits", [
    (1000, 1, 1, 1000),
    (1000, 2, 1, 500),
    (1100, 1, 256, 1024),  # in whole steps
])
def test_contexts_in(budget, per_token, step, fits):
    assert km.contexts_in(budget, lambda n: n * per_token, start=0, step=step) == fits


def test_context_rows_compare_each_arm_with_its_16_bit_arm():
    arms = [{"context": 8192, "bits": b, "kv_bytes": kv, "peak_beyond_weights": peak, "ttft_s": 1.0,
             "decode_tok_s": tok_s, "fits_context_x": x}
            for b, kv, peak, tok_s, x in ((16, 2**30, 2 * 2**30, 100.0, 1.0), (8, 2**29, 2**30, 97.0, 1.88))]
    rows = km.context_rows(arms)
    assert [r[1] for r in rows] == ["16", "8"]
    assert rows[1][4] == "0.50x" and rows[1][7] == "0.97x" and rows[1][8] == "1.88x"
    assert rows[0][2] == "1024"


def test_svg_plot_draws_a_line_per_series():
    svg = km.svg_plot({"grown": [10 * 2**20, 12 * 2**20, 14 * 2**20], "allocated": [14 * 2**20] * 3})
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and "grown" in svg and "14 MiB" in svg
