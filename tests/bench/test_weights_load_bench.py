"""bench/weights_load.py (issue 25 item 3, lazy weight loading): its pure
parts as tables -- the run order, /proc/self/status, mincore's vector, the
child's result line, medians, the summary, the comparison and the table --
and one quick run of the benchmark itself on demo model a."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from testkit import ROOT, load_bench

wl = load_bench("weights_load")
MIB = 1024 * 1024


# --- the run order ------------------------------------------------------------------------------

@pytest.mark.parametrize("arms, rounds, caches, expected", [
    (["eager", "lazy", "lazy_eval"], 1, ["warm"],
     [(0, "warm", "eager"), (0, "warm", "lazy"), (0, "warm", "lazy_eval")]),
    (["eager", "lazy", "lazy_eval"], 3, ["warm"],  # rotated by one each round: no arm always first
     [(0, "warm", "eager"), (0, "warm", "lazy"), (0, "warm", "lazy_eval"),
      (1, "warm", "lazy"), (1, "warm", "lazy_eval"), (1, "warm", "eager"),
      (2, "warm", "lazy_eval"), (2, "warm", "eager"), (2, "warm", "lazy")]),
    (["eager", "lazy"], 2, ["warm", "cold"],
     [(0, "warm", "eager"), (0, "warm", "lazy"), (1, "warm", "lazy"), (1, "warm", "eager"),
      (0, "cold", "eager"), (0, "cold", "lazy"), (1, "cold", "lazy"), (1, "cold", "eager")]),
    (["lazy"], 2, ["cold"], [(0, "cold", "lazy"), (1, "cold", "lazy")]),
])
def test_schedule_alternates_and_rotates_the_arms(arms, rounds, caches, expected):
    assert wl.schedule(arms, rounds, caches) == expected


def test_every_arm_runs_equally_often_in_each_position():
    n = len(wl.ARMS)
    plan = wl.schedule(list(wl.ARMS), n, ["warm"])
    for pos in range(n):
        assert sorted(plan[r * n + pos][2] for r in range(n)) == sorted(wl.ARMS)


# --- what a process reads about itself ------------------------------------------------------------

STATUS = """Name:\tpython
VmPeak:\t 3000000 kB
VmHWM:\t 1500000 kB
VmRSS:\t 1400000 kB
RssAnon:\t 1300000 kB
VmSwap:\t       0 kB
Threads:\t8
"""


@pytest.mark.parametrize("text, expected", [
    (STATUS, {"VmHWM": 1500000 * 1024, "VmRSS": 1400000 * 1024, "VmSwap": 0}),
    ("VmRSS:\t12 kB\n", {"VmRSS": 12 * 1024}),
    ("VmRSS:\t12\n", {"VmRSS": 12 * 1024}),  # no unit: kB, as the kernel writes it
    ("VmRSS:\tgarbage kB\nName:\tx\n", {}),
    ("", {}),
])
def test_parse_proc_status_reads_rss_and_its_peak_in_bytes(text, expected):
    assert wl.parse_proc_status(text) == expected


@pytest.mark.parametrize("vec, expected", [
    ([1, 1, 1, 1], 1.0),
    ([0, 0, 0, 0], 0.0),
    ([1, 0, 3, 2], 0.5),  # only bit 0 means resident; other bits are the kernel's own
    ([], None),
])
def test_resident_fraction_counts_bit_zero(vec, expected):
    got = wl.resident_fraction(vec)
    assert math.isnan(got) if expected is None else got == expected


@pytest.mark.parametrize("stdout, expected", [
    (f"noise\n{wl.RESULT_MARK}{{\"arm\": \"lazy\"}}\n", {"arm": "lazy"}),
    (f"{wl.RESULT_MARK}{{\"n\": 1}}\n{wl.RESULT_MARK}{{\"n\": 2}}\n", {"n": 2}),  # the last one
    ("no result here\n", None),
    ("", None),
])
def test_parse_child_output_finds_the_marked_line(stdout, expected):
    assert wl.parse_child_output(stdout) == expected


@pytest.mark.parametrize("xs, expected", [
    ([3.0, 1.0, 2.0], 2.0),
    ([4.0, 1.0, 2.0, 3.0], 2.5),
    ([1.0, None, math.nan, 5.0], 3.0),  # missing values left out
    ([7.0], 7.0),
])
def test_median(xs, expected):
    assert wl.median(xs) == expected


def test_median_of_nothing_is_nan():
    assert math.isnan(wl.median([])) and math.isnan(wl.median([None, math.nan]))


# --- summary, comparison, table -------------------------------------------------------------------

def run(arm, cache="warm", load=1.0, ttft=0.5, second=0.2, hwm=1500, active=1400, peak=1400, error=None,
        load_cpu=1.0, first_cpu=3.0, second_cpu=2.0):
    if error:
        return {"arm": arm, "cache": cache, "error": error}
    mem = {"rss": hwm * MIB - MIB, "hwm": hwm * MIB, "mlx_active": active * MIB, "mlx_peak": peak * MIB}
    return {"arm": arm, "cache": cache, "load_s": load, "load_to_first_token_s": load + ttft,
            "load_cpu_s": load_cpu, "first_cpu_s": first_cpu, "second_cpu_s": second_cpu,
            "load_and_first_cpu_s": load_cpu + first_cpu,
            "first": {"ttft_s": ttft}, "second": {"ttft_s": second}, "page_cache_before": 1.0,
            "after_load": mem, "after_first": {**mem, "mlx_peak": 100 * MIB}}


RUNS = [
    run("eager", load=1.0), run("eager", load=1.2), run("eager", load=3.0),
    run("lazy", load=0.1, ttft=1.4, active=0, peak=0, load_cpu=0.1, first_cpu=4.0),
    run("lazy", load=0.1, ttft=1.6, active=0, peak=0, load_cpu=0.1, first_cpu=4.0),
    run("lazy", error="exit 1: boom"),
    run("eager", cache="cold", load=2.0),
]


def test_summarize_takes_medians_and_ranges_per_cache_and_arm():
    s = wl.summarize(RUNS)
    assert list(s) == ["warm", "cold"] and list(s["warm"]) == ["eager", "lazy"]
    e = s["warm"]["eager"]
    assert e["load_s"] == {"median": 1.2, "min": 1.0, "max": 3.0, "n": 3}
    assert e["load_to_first_token_s"]["median"] == pytest.approx(1.7)
    assert e["errors"]["n"] == 0
    lz = s["warm"]["lazy"]
    assert lz["load_s"]["n"] == 2 and lz["errors"]["n"] == 1  # the failed run counted, not averaged
    assert lz["ttft_s"]["median"] == pytest.approx(1.5)
    assert lz["mlx_active_loaded"]["median"] == 0
    assert lz["mlx_peak_first"]["median"] == 100 * MIB
    assert s["cold"]["eager"]["load_s"]["median"] == 2.0


def test_summarize_of_only_failures_gives_nan_figures():
    s = wl.summarize([run("lazy", error="x")])
    assert math.isnan(s["warm"]["lazy"]["load_s"]["median"]) and s["warm"]["lazy"]["load_s"]["n"] == 0


def test_compare_gives_differences_to_eager():
    c = wl.compare(wl.summarize(RUNS))
    d = c["warm"]["lazy"]
    assert d["load_s"] == pytest.approx(0.1 - 1.2)
    assert d["load_to_first_token_s"] == pytest.approx((0.1 + 1.5) - 1.7)
    assert d["hwm_first"] == 0
    assert d["load_and_first_cpu_s"] == pytest.approx(4.1 - 4.0)
    assert d["mlx_peak_loaded"] == -1400 * MIB
    assert "cold" not in c  # no other arm there to compare


def test_compare_without_the_base_arm_is_empty():
    assert wl.compare(wl.summarize([run("lazy")])) == {}


def test_table_shows_medians_ranges_memory_and_failures():
    md = wl.table(wl.summarize(RUNS), "demo-c", "Device(cpu, 0)")
    assert "**demo-c, Device(cpu, 0), page cache warm** (medians of 3 runs" in md
    assert ("| lazy=False (today) | 1.20 (1.00–3.00) | 0.50 | 1.70 (1.50–3.50) | 0.20 | "
            "1.00 | 3.00 | 2.00 | 4.00 | 100 % |") in md
    assert ("| lazy=True, read by the 1st request (1 failed) | 0.10 | 1.50 (1.40–1.60) | 1.60 (1.50–1.70) | 0.20 | "
            "0.10 | 4.00 | 2.00 | 4.10 | 100 % |") in md
    assert "| lazy=False (today) | 1,499 | 1,500 | 1,499 | 1,500 | 1,400 | 1,400 | 1,400 | 100 |" in md
    assert "| lazy=True, read by the 1st request | 1,499 | 1,500 | 1,499 | 1,500 | 0 | 0 | 0 | 100 |" in md
    assert "page cache cold" in md


def test_table_marks_missing_figures():
    md = wl.table(wl.summarize([run("lazy", error="x")]), "m", "d")
    assert "| lazy=True, read by the 1st request (1 failed) | — | — | — | — | — | — | — | — | — |" in md  # noqa: E501


# --- options --------------------------------------------------------------------------------------

def test_defaults_and_quick():
    a = wl.parse_args([])
    assert (a.variant, a.rounds, a.max_tokens, a.arms_list, a.cache_list) == (
        "c", 3, 16, ["eager", "lazy", "lazy_eval", "lazy_chunks"], ["warm", "cold"])
    q = wl.parse_args(["--quick"])
    assert a.warmup == 1
    assert (q.variant, q.rounds, q.max_tokens, q.cache_list, q.float32, q.warmup) == ("a", 1, 4, ["warm"], False, 0)
    assert wl.parse_args(["--quick", "--warmup", "2"]).warmup == 2
    assert wl.parse_args(["--float32"]).float32 is True
    o = wl.parse_args(["--arms", "lazy,eager", "--cache", "cold", "--rounds", "5", "--model-dir", "/m",
                       "--json-out", "/o.json"])
    assert (o.arms_list, o.cache_list, o.rounds, str(o.model_dir), str(o.json_out)) == (
        ["eager", "lazy"], ["cold"], 5, "/m", "/o.json")
    with pytest.raises(SystemExit):
        wl.parse_args(["--arms", "mmap"])
    with pytest.raises(SystemExit):
        wl.parse_args(["--cache", "hot"])


# --- the benchmark itself, quick ------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.timeout(120)
def test_quick_run_measures_every_arm_on_demo_model_a(tmp_path):
    out = tmp_path / "weights_load.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "weights_load.py"), "--quick", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert sorted(r["arm"] for r in runs) == sorted(wl.ARMS)
    by = {r["arm"]: r for r in runs}
    for r in runs:
        assert not r.get("error"), r
        assert r["first"]["tokens"] >= 1 and r["first"]["ttft_s"] > 0
        assert r["after_first"]["hwm"] >= r["after_first"]["rss"] > 0
        assert r["page_cache_before"] in (None, 1.0) or r["page_cache_before"] > 0.9  # warm
    weights = doc["model"]["weight_bytes"]
    # eager and the evaluated lazy arms hold every weight once loaded; lazy holds none until the first request
    assert by["eager"]["after_load"]["mlx_active"] >= 0.9 * weights
    assert by["lazy_eval"]["after_load"]["mlx_active"] >= 0.9 * weights
    assert by["lazy_chunks"]["after_load"]["mlx_active"] >= 0.9 * weights
    assert by["lazy"]["after_load"]["mlx_active"] < 0.1 * weights
    assert by["lazy"]["after_first"]["mlx_active"] >= 0.9 * weights
    answers = {tuple(r[req]["token_ids"]) for r in runs for req in ("first", "second")}
    assert len(answers) == 1, answers  # greedy on the same weights: every arm, every request, the same tokens
    assert "| lazy=False (today) |" in proc.stdout


def test_the_load_speed_is_set_against_the_files_read_speed_per_cache_mode():
    gb = 10**9
    runs = [{"cache": "cold", "arm": "eager", "load_s": s} for s in (2.0, 4.0, 3.0)]
    runs += [{"cache": "cold", "arm": "lazy", "load_s": 0.1}]  # only eager loads read every weight
    text = wl.speed_lines(3 * gb, runs, {"cold": {"gb_per_s": 2.0}, "warm": {"gb_per_s": 9.0}})
    assert text.splitlines() == [
        "- cold: eager load 1.00 GB/s (3.00 s a load, 1.00 s per GB) against reading the files 2.00 GB/s in one "
        "sequential stream: the load at 0.50x the read's speed"]  # no eager run warm: no line


def test_reading_the_files_counts_every_byte(tmp_path):
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    files[0].write_bytes(b"x" * 1000)
    files[1].write_bytes(b"y" * 24)
    for cache in ("warm", "cold"):
        read = wl.read_speed(files, cache)
        assert read["bytes"] == 1024 and read["gb_per_s"] > 0
