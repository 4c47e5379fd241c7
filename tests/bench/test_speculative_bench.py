"""bench/speculative.py's pure part: the per-workload summary (speedup,
tokens a forward, acceptance, whether the arms' answers were identical)."""

from __future__ import annotations

import pytest

from testkit import load_bench

spec = load_bench("speculative")


def run(workload, arm, rate, text, **counters):
    return {"workload": workload, "arm": arm, "decode_tok_s": rate, "ttft_s": 0.1, "tokens": 100, "text": text,
            "spec": {"proposed": 0, "accepted": 0, "forwards": 0, "tokens": 0, **counters}}


def test_the_summary_sets_prompt_lookup_against_off_per_workload():
    runs = [run("edit", "off", 20.0, "a"), run("edit", "off", 22.0, "a"),
            run("edit", "prompt_lookup", 44.0, "a", proposed=80, accepted=60, forwards=40, tokens=100),
            run("edit", "prompt_lookup", 40.0, "a", proposed=20, accepted=20, forwards=10, tokens=100),
            run("chat", "off", 20.0, "b"), run("chat", "prompt_lookup", 19.0, "c")]
    s = spec.summarize(runs)
    assert s["edit"]["speedup"] == pytest.approx(42.0 / 21.0)
    assert s["edit"]["prompt_lookup"]["tokens_per_forward"] == pytest.approx(200 / 50)
    assert s["edit"]["prompt_lookup"]["acceptance"] == pytest.approx(80 / 100)
    assert s["edit"]["identical"] and not s["chat"]["identical"]  # a different answer is a failure, said so
    assert s["chat"]["prompt_lookup"]["acceptance"] is None  # nothing proposed
    assert "| chat | prompt_lookup | 19.0 | 0.95x |" in spec.table(s) and "NO |" in spec.table(s)


def test_a_draft_arm_is_set_against_off_as_well():
    runs = [run("edit", "off", 20.0, "a"), run("edit", "prompt_lookup", 30.0, "a"),
            run("edit", "draft", 50.0, "b", proposed=30, accepted=15, forwards=20, tokens=100)]
    s = spec.summarize(runs)
    assert s["edit"]["draft"]["speedup"] == pytest.approx(2.5) and s["edit"]["speedup"] == pytest.approx(1.5)
    assert s["edit"]["prompt_lookup"]["identical"] and not s["edit"]["draft"]["identical"]
    assert not s["edit"]["identical"]
    assert "| edit | draft | 50.0 | 2.50x | 5.00 | 50% | NO |" in spec.table(s)


def test_the_verify_cost_table_has_a_row_per_forward_size_and_a_column_per_context():
    rows = [{"context": c, "tokens": n, "ms": 10.0 * n, "vs_step": float(n)} for c in (512, 4096)
            for n in spec.VERIFY_TOKENS if n != 17]
    md = spec.verify_table(rows)
    assert "| context 512 | context 4096 |" in md
    assert "| 9 (8) | 90.0 ms (9.00x) | 90.0 ms (9.00x) |" in md
    assert "| 17 (16) | — | — |" in md  # not measured: said so, not invented
