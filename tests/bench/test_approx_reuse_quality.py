"""bench/approx_reuse_quality.py's pure parts, as tables: the fixed prompt
set, the same-length pairing of old and new values, agreement counting, the
summary and its table, which BLAS is in use. No model is loaded."""

from __future__ import annotations

import re

import pytest

from testkit import load_bench

aq = load_bench("approx_reuse_quality")


def chars(messages):
    """A stand-in tokenizer: one token per character of every message."""
    return [ord(c) for m in messages for c in m["role"] + "\n" + m["content"]]


def spec_with(old: str, *candidates: str, system: str = "Time: {clock}. Be brief.") -> "aq.PromptSpec":
    return aq.PromptSpec("t", "coding", "clock", "start", system, (), "Why?", False, {"clock": old},
                         tuple({"clock": c} for c in candidates))


# --- the prompt set --------------------------------------------------------------------

SPECS = aq.prompt_specs(24)


def test_the_prompt_set_is_fixed_and_varied():
    assert aq.prompt_specs(24) == SPECS  # deterministic: the same set every run
    assert len({s.id for s in SPECS}) == 24
    assert {s.kind for s in SPECS} == set(aq.KINDS)
    assert {s.place for s in SPECS} == set(aq.PLACES)
    assert {s.persona for s in SPECS} == set(aq.PERSONAS)
    assert len({s.system for s in SPECS}) == 24
    assert sum(1 for s in SPECS if s.history) == 8  # every third prompt has an earlier exchange
    asking = [s for s in SPECS if s.asks_value]
    assert len(asking) == 6 and {s.kind for s in asking} == set(aq.KINDS)  # a quarter, every kind
    assert all(s.question == aq.VALUE_QUESTIONS[s.kind.split("+")[0]] for s in asking)
    assert all(s.question not in aq.VALUE_QUESTIONS.values() for s in SPECS if not s.asks_value)
    assert aq.prompt_specs(24, seed=1) != SPECS


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.id)
def test_every_prompt_holds_its_volatile_values_once(spec):
    for name in spec.kind.split("+"):
        assert spec.system.count("{" + name + "}") == 1
        assert all(c[name] != spec.old[name] for c in spec.candidates)
    assert len(spec.candidates) == aq.CANDIDATES
    words = len(spec.messages(spec.old)[0]["content"].split())
    assert 140 <= words <= 480  # about 200-600 tokens with the template
    roles = [m["role"] for m in spec.messages(spec.old)]
    assert roles == ["system"] + ["user", "assistant"] * (len(spec.history) // 2) + ["user"]
    assert "{" not in spec.messages(spec.old)[0]["content"]  # every placeholder filled


@pytest.mark.parametrize("kind, place, first_line, last_line", [
    ("clock", "start", "Current time is", None),
    ("counter", "end", None, "This is request #"),
    ("clock+counter", "start", "Current time is", "This is request #"),
    ("clock+counter", "end", "This is request #", "Current time is"),
])
def test_where_the_volatile_lines_go(kind, place, first_line, last_line):
    spec = next(s for s in SPECS if s.kind == kind and s.place == place)
    paragraphs = spec.messages(spec.old)[0]["content"].split("\n\n")
    if first_line:
        assert paragraphs[0].startswith(first_line)
    if last_line:
        assert paragraphs[-1].startswith(last_line)


@pytest.mark.parametrize("name, pattern", [
    ("clock", r"2026-1[12]-\d\d \d\d:\d\d:\d\d"),
    ("date", r"[A-Z][a-z]+day, [A-Z][a-z]+ \d\d, 20\d\d"),
    ("session", r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"),
    ("counter", r"\d{2,4}"),
])
def test_values_are_what_a_later_request_would_carry(name, pattern):
    import random

    old, candidates = aq._values(name, random.Random(3))
    assert re.fullmatch(pattern, old)
    assert all(re.fullmatch(pattern, c) for c in candidates)
    later = {"clock": lambda v: v, "date": None, "session": None, "counter": int}[name]
    if later is not None:  # a clock and a counter only move forward
        assert all(later(c) > later(old) for c in candidates)


# --- pairing values of the same token length -------------------------------------------------

@pytest.mark.parametrize("old, candidates, new, skipped", [
    ("10:42:13", ("10:42:14",), "10:42:14", 0),                       # same width: the first candidate
    ("999", ("1000", "1001", "998"), "998", 2),                       # longer ones skipped and counted
    ("9", ("10", "11"), None, 2),                                     # none fits: dropped
    ("abc", ("abcd", "ab", "xyz"), "xyz", 2),
])
def test_pairing_keeps_the_token_count(old, candidates, new, skipped):
    pair, n_skipped = aq.pair_values(spec_with(old, *candidates), chars)
    assert n_skipped == skipped
    if new is None:
        assert pair is None
    else:
        assert pair.new == {"clock": new} and pair.skipped == skipped
        assert len(pair.tokens_a) == len(pair.tokens_b) and pair.tokens_a != pair.tokens_b


def test_a_candidate_that_tokenizes_the_same_is_passed_over():
    digits_blind = lambda messages: [0 if chr(t).isdigit() else t for t in chars(messages)]  # noqa: E731
    pair, skipped = aq.pair_values(spec_with("12", "13", "1x"), digits_blind)
    assert pair.new == {"clock": "1x"} and skipped == 0  # "13" is not a change to this tokenizer, not a mismatch


def test_two_values_change_together():
    spec = next(s for s in SPECS if s.kind == "clock+counter")
    pair, _ = aq.pair_values(spec, chars)
    assert set(pair.new) == {"clock", "counter"}
    a, b = pair.tokens_a, pair.tokens_b
    changed = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    assert changed[-1] - changed[0] > 500  # two spans far apart (the lines at opposite ends)


# --- agreement counting ----------------------------------------------------------------------

@pytest.mark.parametrize("reference, got, n, expected", [
    ([1, 2, 3, 4], [1, 2, 3, 4], 4, 4),   # identical: N
    ([1, 2, 3, 4], [1, 2, 9], 4, 2),      # decoding stopped at the differing token
    ([1, 2, 3, 4], [7], 4, 0),            # the first token already differs
    ([1, 2, 3, 4], [1, 2], 4, 2),         # cut short counts as a difference where it ends
    ([1, 2, 3, 4], [1, 2, 3, 4, 5], 3, 3),  # only the first n count
    ([], [], 0, 0),
])
def test_first_difference(reference, got, n, expected):
    assert aq.first_difference(reference, got, n) == expected


def row(arm, first_difference, first_top1=True, first_kl=0.0, forced_top1=1.0, forced_kl=0.0, reused=0.5,
        spans=(), tokens=4):  # tokens: the reference's answer, N or fewer (EOS)
    return {"arm": arm, "tokens": tokens, "first_difference": first_difference, "first_top1": first_top1,
            "first_kl": first_kl, "forced_top1": forced_top1, "forced_kl": forced_kl, "reused_share": reused,
            "spans": list(spans)}


ROWS = [row("exact", 4, reused=0.1), row("exact", 4, reused=0.3),
        row("approx r0", 4, first_kl=0.01, reused=0.9, spans=[(3, 5)]),
        row("approx r0", 0, first_top1=False, first_kl=0.5, forced_top1=0.5, forced_kl=0.2, reused=0.7),
        row("approx r4", 1, forced_top1=0.75, forced_kl=0.1, reused=0.8, spans=[(3, 9)]),
        row("approx r4", 2, reused=0.8, spans=[(3, 9)], tokens=2)]  # a reference that ended at EOS


@pytest.mark.parametrize("arm, field, expected", [
    ("exact", "prompts", 2),
    ("exact", "mean_agreeing_tokens", 4.0),
    ("exact", "identical_share", 1.0),
    ("exact", "reused_share", 0.2),
    ("exact", "patched", 0),
    ("approx r0", "mean_agreeing_tokens", 2.0),
    ("approx r0", "identical_share", 0.5),
    ("approx r0", "first_top1", 0.5),
    ("approx r0", "first_kl", 0.255),
    ("approx r0", "forced_top1", 0.75),
    ("approx r0", "forced_kl", 0.1),
    ("approx r0", "reused_share", 0.8),
    ("approx r0", "patched", 1),
    ("approx r4", "identical_share", 0.5),  # 2 of a 2-token reference: identical
    ("approx r4", "tokens", 3.0),
    ("approx r4", "mean_agreeing_tokens", 1.5),
])
def test_summary(arm, field, expected):
    summary = {s["arm"]: s for s in aq.summarize(ROWS, aq.arm_names([0, 4, 16]))}
    assert summary[arm][field] == pytest.approx(expected)


def test_summary_keeps_the_arms_order_and_leaves_out_arms_without_rows():
    assert [s["arm"] for s in aq.summarize(ROWS, ["approx r4", "exact", "approx r16", "approx r0"])] == \
        ["approx r4", "exact", "approx r0"]


def test_the_table():
    lines = aq.markdown_table(aq.summarize(ROWS, aq.arm_names([0, 4]))).splitlines()
    assert len(lines) == 2 + 3
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[2] == "| exact | 2 | 4.0 / 4.0 | 100 % | 100 % | 0 | 100 % | 0 | 20 % |"
    assert lines[3] == "| approx r0 (1/2 patched) | 2 | 2.0 / 4.0 | 50 % | 50 % | 0.26 | 75 % | 0.1 | 80 % |"


def test_the_control_arm_is_named_as_one():
    rows = [row("stale", 1, reused=0.99), row("exact", 3)]
    lines = aq.markdown_table(aq.summarize(rows, aq.arm_names([], control=True))).splitlines()
    assert lines[3].startswith("| stale (control: nothing recomputed) | 1 | 1.0 / 4.0 | 0 % |")


@pytest.mark.parametrize("values, control, expected", [
    ([0], False, ["exact", "approx r0"]),
    ([0, 4, 16], True, ["exact", "approx r0", "approx r4", "approx r16", "stale"]),
    ([], False, ["exact"]),
])
def test_arm_names(values, control, expected):
    assert aq.arm_names(values, control) == expected
