"""bench/kv_quality.py's pure parts, as tables: the fixed prompt set and
passage, the --bits setting, agreement counting, the greedy and perplexity
summaries and their tables. No model is loaded, except in the one quick run
on the real default model at the end (integration)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from testkit import ROOT, load_bench, real_default_model

kq = load_bench("kv_quality")


# --- the prompt set and the passage ---------------------------------------------------------

PROMPTS = kq.prompt_set()


def test_the_prompt_set_is_fixed_and_varied():
    assert kq.prompt_set() == PROMPTS  # deterministic: the same set every run
    assert len(PROMPTS) == 28 and len({p.id for p in PROMPTS}) == 28
    kinds = [p.kind for p in PROMPTS]
    assert {k: kinds.count(k) for k in set(kinds)} == {"short": 16, "medium": 5, "system": 3, "passage": 4}
    assert len({json.dumps(p.messages) for p in PROMPTS}) == 28  # no prompt twice
    assert [p.kind for p in kq.prompt_set(4)] == ["short", "short", "short", "medium"]  # --quick: the cheap ones
    assert kq.prompt_set(6) == PROMPTS[:6]


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: p.id)
def test_every_prompt_is_a_chat_ending_with_the_user(prompt):
    roles = [m["role"] for m in prompt.messages]
    body = roles[1:] if roles[0] == "system" else roles
    assert body == ["user", "assistant"] * (len(body) // 2) + ["user"]
    assert all(m["content"].strip() for m in prompt.messages)
    words = sum(len(m["content"].split()) for m in prompt.messages)
    low, high = {"short": (3, 20), "medium": (25, 200), "system": (200, 500), "passage": (200, 2000)}[prompt.kind]
    assert low <= words <= high


def test_the_passage_is_long_fixed_prose():
    words = kq.TEXT.split()
    assert len(words) >= 1500  # ~2,200 tokens: well over the 1,500 asked for
    assert kq.TEXT.startswith("It is a truth universally acknowledged")
    assert kq.CHAPTER_1 + "\nChapter 2\n\n" + kq.CHAPTER_2 == kq.TEXT
    assert "_" not in kq.TEXT and "“" not in kq.TEXT  # italics' underscores dropped, straight quotes


@pytest.mark.parametrize("which, starts, ends", [
    ("opening", "It is a truth", '"Bingley."'),
    ("chapter1", "It is a truth", "visiting and news."),
    ("chapter2", "Mr. Bennet was among the earliest", "ask him to dinner."),
    ("whole", "It is a truth", "ask him to dinner."),
])
def test_passages(which, starts, ends):
    text = kq.passage(which)
    assert text.startswith(starts) and text.endswith(ends)


def test_passage_questions_embed_their_passage():
    whole = next(p for p in PROMPTS if p.id == "p-whole")
    assert kq.TEXT.strip() in whole.messages[0]["content"]
    assert whole.messages[0]["content"].endswith("Question: Summarise this passage in a few sentences.")


@pytest.mark.parametrize("tokens, expected", [
    (0, "< 128 tokens"), (37, "< 128 tokens"), (127, "< 128 tokens"),
    (128, "128-511 tokens"), (511, "128-511 tokens"),
    (512, ">= 512 tokens"), (2200, ">= 512 tokens"),
])
def test_length_class(tokens, expected):
    assert kq.length_class(tokens) == expected


# --- settings -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("8,4", [8, 4]),
    ("16,8,4", [16, 8, 4]),
    (" 4 , 8 ", [4, 8]),
    ("2,3,5,6", [2, 3, 5, 6]),
    ("8,", [8]),
])
def test_parse_bits(text, expected):
    assert kq.parse_bits(text) == expected


@pytest.mark.parametrize("text, message", [
    ("", "no KV bits"),
    ("7", "unsupported KV bits [7]"),
    ("8,32", "unsupported KV bits [32]"),
    ("8,8", "repeated"),
])
def test_parse_bits_refuses(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        kq.parse_bits(text)


@pytest.mark.parametrize("argv, prompts, tokens, text_tokens", [
    ([], None, 64, None),
    (["--quick"], 4, 16, 512),
    (["--quick", "--prompts", "2", "--tokens", "8", "--text-tokens", "128"], 2, 8, 128),
    (["--prompts", "10", "--tokens", "32"], 10, 32, None),
])
def test_quick_is_the_small_run(argv, prompts, tokens, text_tokens):
    args = kq.parse_args(argv)
    assert (args.prompts, args.tokens, args.text_tokens) == (prompts, tokens, text_tokens)
    assert args.bits == [8, 4] and args.group_size == 64 and args.chunk == 256


@pytest.mark.parametrize("bits, reference, expected", [
    (16, True, "16 (unquantised, float32): reference"),
    (16, False, "16 (unquantised, float32): control, again"),
    (8, False, "8-bit"),
    (4, False, "4-bit"),
])
def test_arm_label(bits, reference, expected):
    assert kq.arm_label(bits, "float32", reference) == expected


@pytest.mark.parametrize("n, size, expected", [
    (10, 4, [(0, 4), (4, 8), (8, 10)]),
    (8, 4, [(0, 4), (4, 8)]),
    (3, 256, [(0, 3)]),
    (0, 4, []),
])
def test_chunks(n, size, expected):
    assert kq.chunks(n, size) == expected


# --- agreement counting and the greedy summary ---------------------------------------------

# first_difference is benchkit's: tests/bench/test_approx_reuse_quality.py has its table.


def row(bits, first_difference, tokens=4, first_top1=True, first_kl=0.0, forced_top1=1.0, forced_kl=0.0,
        generated=None, decode_seconds=1.0, length="< 128 tokens"):
    return {"bits": bits, "tokens": tokens, "first_difference": first_difference,
            "generated": first_difference + 1 if generated is None else generated, "first_top1": first_top1,
            "first_kl": first_kl, "forced_top1": forced_top1, "forced_kl": forced_kl,
            "decode_seconds": decode_seconds, "length_class": length}


ROWS = [row(8, 4), row(8, 4, tokens=8, forced_top1=0.5, forced_kl=0.04), row(8, 1, first_kl=0.01),
        row(4, 0, first_top1=False, first_kl=0.5, forced_top1=0.5, forced_kl=0.2),
        row(4, 2, tokens=2, forced_top1=1.0, forced_kl=0.1, generated=2, decode_seconds=0.5),  # ended at EOS
        row(4, 1, forced_top1=0.75, forced_kl=0.3)]


@pytest.mark.parametrize("bits, field, expected", [
    (8, "prompts", 3),
    (8, "tokens", 16 / 3),
    (8, "mean_agreeing_tokens", 3.0),
    (8, "median_agreeing_tokens", 4.0),
    (8, "identical", 1),                      # 4 of 8 is not the whole answer
    (8, "first_top1", 1.0),
    (8, "first_kl", 0.01 / 3),
    (8, "forced_top1", (4 + 4 + 4) / 16),     # over all the 16 steps, not the mean of 3 means
    (8, "forced_kl", 8 * 0.04 / 16),
    (8, "decode_tok_s", (5 + 5 + 2) / 3.0),
    (4, "identical", 1),                      # 2 of a 2-token answer
    (4, "mean_agreeing_tokens", 1.0),
    (4, "median_agreeing_tokens", 1.0),
    (4, "first_top1", 2 / 3),
    (4, "forced_top1", (2 + 2 + 3) / 10),
    (4, "forced_kl", (0.8 + 0.2 + 1.2) / 10),
    (4, "decode_tok_s", (1 + 2 + 2) / 2.5),
])
def test_summary(bits, field, expected):
    summary = {s["bits"]: s for s in kq.summarize(ROWS, [8, 4])}
    assert summary[bits][field] == pytest.approx(expected)


def test_summary_keeps_the_settings_order_and_leaves_out_settings_without_rows():
    assert [s["bits"] for s in kq.summarize(ROWS, [4, 16, 8])] == [4, 8]
    assert kq.summarize([], [8, 4]) == []


def test_the_greedy_table():
    lines = kq.greedy_table(kq.summarize(ROWS + [row(16, 4), row(16, 2, tokens=2)], [16, 8, 4]),
                            "float32").splitlines()
    assert len(lines) == 2 + 3
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[1] == "|" + "---|" * 9
    assert lines[2] == ("| 16 (unquantised, float32): control, again | 2 | 3.0 / 3 (3.0) | 2/2 | 100 % | 0 "
                        "| 100.0 % | 0 | 4.0 |")
    assert lines[3] == "| 8-bit | 3 | 3.0 / 4 (5.3) | 1/3 | 100 % | 0.0033 | 75.0 % | 0.02 | 4.0 |"
    assert lines[4] == "| 4-bit | 3 | 1.0 / 1 (3.3) | 1/3 | 67 % | 0.17 | 70.0 % | 0.22 | 2.0 |"


# --- perplexity ------------------------------------------------------------------------------

def stat(bits, role, scored, ppl, top1=None, kl=None, seconds=2.0, kv=46080.0):
    return {"bits": bits, "role": role, "scored": scored, "nll": math.log(ppl) * scored, "top1": top1, "kl": kl,
            "seconds": seconds, "kv_bytes_per_token": kv}


STATS = [stat(16, "reference", 100, 16.0), stat(16, "arm", 100, 16.0, top1=100, kl=0.0),
         stat(8, "arm", 100, 16.08, top1=98, kl=0.05, seconds=4.0, kv=12960.0),
         stat(4, "arm", 100, 18.0, top1=80, kl=11.0, kv=7200.0)]


@pytest.mark.parametrize("i, field, expected", [
    (0, "ppl", 16.0), (0, "delta_pct", None), (0, "top1", None), (0, "kl", None), (0, "tok_s", 50.0),
    (1, "delta_pct", 0.0), (1, "top1", 1.0), (1, "kl", 0.0),
    (2, "ppl", 16.08), (2, "delta_pct", 0.5), (2, "top1", 0.98), (2, "kl", 0.0005), (2, "tok_s", 25.0),
    (2, "kv_bytes_per_token", 12960.0),
    (3, "delta_pct", 12.5), (3, "top1", 0.8), (3, "kl", 0.11),
])
def test_ppl_summary(i, field, expected):
    line = kq.ppl_summary(STATS)[i]
    assert line[field] == (None if expected is None else pytest.approx(expected))


def test_ppl_summary_clamps_rounding_below_zero_and_survives_no_reference():
    assert kq.ppl_summary([stat(16, "reference", 10, 5.0), stat(8, "arm", 10, 5.0, top1=10, kl=-1e-9)])[1]["kl"] == 0
    alone = kq.ppl_summary([stat(8, "arm", 10, 5.0, top1=10, kl=0.1)])[0]
    assert alone["ppl"] == pytest.approx(5.0) and alone["delta_pct"] is None


def test_the_ppl_table():
    lines = kq.ppl_table(kq.ppl_summary(STATS), "float32").splitlines()
    assert len(lines) == 2 + 4
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[2] == "| 16 (unquantised, float32): reference | 100 | 16.000 | — | — | — | 46,080 | 50 |"
    assert lines[3] == ("| 16 (unquantised, float32): control, again | 100 | 16.000 | +0.00 % | 100.0 % | 0 "
                        "| 46,080 | 50 |")
    assert lines[4] == "| 8-bit | 100 | 16.080 | +0.50 % | 98.0 % | 0.0005 | 12,960 | 25 |"
    assert lines[5] == "| 4-bit | 100 | 18.000 | +12.50 % | 80.0 % | 0.11 | 7,200 | 50 |"


# --- one quick run on the real default model ------------------------------------------------------

@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_quick_run_on_the_real_default_model(tmp_path):
    """The smallest run (~25 s on 2 idle cores; other programs on the same
    cores slow it several-fold, hence the timeout): two short prompts, 8
    tokens, 128 tokens of the passage, 16 as an arm too. The 16-bit control
    repeats the reference's computation, so it must agree exactly; the
    8-bit results must be well-formed."""
    gguf = real_default_model()
    env = {k: v for k, v in os.environ.items() if k != "MLXD_CPU_BLAS"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "kv_quality.py"), "--quick", "--prompts", "2", "--tokens", "8",
         "--text-tokens", "128", "--chunk", "64", "--bits", "16,8", "--gguf", str(gguf), "--out-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=280)
    out = tmp_path / "kv_quality.json"
    assert out.is_file(), f"no results (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert sorted((r["prompt"], r["bits"]) for r in rows) == [("s00", 8), ("s00", 16), ("s01", 8), ("s01", 16)]
    for r in rows:
        assert 1 <= r["tokens"] <= 8 and 0 <= r["first_difference"] <= r["tokens"]
        assert r["identical"] == (r["first_difference"] == r["tokens"])
        assert 0.0 <= r["forced_top1"] <= 1.0
        assert math.isfinite(r["forced_kl"]) and r["forced_kl"] >= 0 and math.isfinite(r["first_kl"])
        if r["bits"] == 16:  # the reference's computation again: exactly the same
            assert r["identical"] and r["generated_text"] == r["reference_text"], r
            assert r["first_top1"] and r["forced_top1"] == 1.0 and r["first_kl"] == 0.0 and r["forced_kl"] == 0.0
    lines = {(ln["bits"], ln["role"]): ln for ln in doc["perplexity"]["lines"]}
    assert set(lines) == {(16, "reference"), (16, "arm"), (8, "arm")}
    assert doc["perplexity"]["tokens"] == 128 and all(ln["scored"] == 127 for ln in lines.values())
    ref, control, eight = lines[16, "reference"], lines[16, "arm"], lines[8, "arm"]
    assert 1 < ref["ppl"] < 1000
    assert control["ppl"] == ref["ppl"] and control["delta_pct"] == 0.0 and control["top1"] == 1.0
    assert control["kl"] == 0.0
    assert math.isfinite(eight["ppl"]) and math.isfinite(eight["delta_pct"]) and 0.0 <= eight["top1"] <= 1.0
    assert eight["kl"] >= 0 and eight["kv_bytes_per_token"] < ref["kv_bytes_per_token"] / 2
    assert "| 8-bit |" in proc.stdout and "| 16 (unquantised" in proc.stdout
