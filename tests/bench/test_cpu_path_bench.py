"""bench/cpu_path.py (issue 26's fast CPU path): its pure parts as tables --
each arm's environment and engine config, what the engine's log says, the
prompts, the comparison, the goals, the table and the suite's figures -- and
one short run of the benchmark itself on the real default model: every arm
measured, 'after' on the fast BLAS and float32 wherever this machine has the
fast path, the ~2,000-token prompt answered 200 by the engine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from testkit import ROOT, load_bench, real_default_model

cp = load_bench("cpu_path")
suite = load_bench("run")


# --- the arms -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arm, base, blas_env, threads", [
    ("before", {}, "reference", None),
    ("blas-only", {"MLXD_CPU_BLAS": "reference"}, None, None),  # the caller's opt-out never leaks into an arm
    ("after", {"MLXD_CPU_BLAS": "reference", "OPENBLAS_NUM_THREADS": "1"}, None, None),
    ("after-1t", {}, None, "1"),
])
def test_arm_env_sets_the_opt_out_for_the_reference_arm_only(arm, base, blas_env, threads):
    env = cp.arm_env(cp.ARMS[arm], {"PATH": "/bin", **base})
    assert env.get("MLXD_CPU_BLAS") == blas_env
    assert env.get("OPENBLAS_NUM_THREADS") == threads
    assert env["PATH"] == "/bin"


@pytest.mark.parametrize("arm, float32", [("before", False), ("blas-only", False), ("after", True)])
def test_engine_toml_serves_the_gguf_as_default_with_the_arm_s_dtype(tmp_path, arm, float32):
    from mlxd.config import parse_config

    gguf = tmp_path / "m.gguf"
    data = tomllib.loads(cp.engine_toml(gguf, cp.ARMS[arm]))
    assert data["engine"]["cpu_float32"] is float32
    assert data["engine"]["prompt_cache"] == {"enabled": False}
    assert data["models"]["smollm2"] == {"gguf": str(gguf.resolve())}
    assert data["aliases"] == {"default": "smollm2"}
    config = parse_config(data, tmp_path)  # the engine accepts it
    assert config.engine.stuck_grace_s == 30.0  # the default grace: the long prompt is judged by it


@pytest.mark.parametrize("arm, layout", [("before", None), ("after", None), ("after-1t", None),
                                         ("after-stored", "stored"), ("after-transposed", "transposed"),
                                         ("after-split", "split")])
def test_a_layout_arm_starts_its_engine_through_this_script(arm, layout):
    """The engine has no layout setting: an arm with one runs `mlxd engine`
    through cpu_path.py's --engine-layout mode, nothing in its environment."""
    a = cp.ARMS[arm]
    assert a.layout == layout
    assert not any(k.startswith("MLXD_CPU_LAYOUT") for k in cp.arm_env(a, {"PATH": "/bin"}))
    launcher = cp.engine_launcher(a)
    if layout is None:
        assert launcher == []
    else:
        assert launcher == [sys.executable, str(ROOT / "bench" / "cpu_path.py"), "--engine-layout", layout, "--"]
        assert layout in load_bench("cpu_arms").LAYOUTS


@pytest.mark.parametrize("command", [["python", "-m", "mlxd.other", "engine"], ["python", "-m", "mlxd.cli"], []])
def test_the_engine_layout_mode_runs_only_mlxd_cli(command):
    with pytest.raises(SystemExit, match="--engine-layout"):
        cp.engine_with_layout("split", command)


def test_default_arms_are_before_blas_only_after():
    assert cp.parse_args([]).arms_list == ["before", "blas-only", "after"]
    assert cp.parse_args([]).long_arms_list == ["before", "blas-only", "after"]
    q = cp.parse_args(["--quick"])
    assert (q.rounds, q.long_arms_list, q.profile) == (1, ["after"], False)
    with pytest.raises(SystemExit):
        cp.parse_args(["--arms", "before,bf16"])


# --- the engine's log -----------------------------------------------------------------------------

LOG_FAST = """\
2026-11-25 14:38:07,604 INFO mlxd.engine: MLX's CPU backend uses openblas (system) (libopenblas.so.0)
2026-11-25 14:38:10,978 INFO mlxd.engine.gguf: converted m.gguf in 1.5s into /h/models/gguf/m-1
2026-11-25 14:38:21,334 INFO mlxd.engine.core.worker: loaded smollm2 in 10.3s (MLX active 513 MiB, as float32: the CPU's fast path)
"""
LOG_REFERENCE = """\
2026-11-25 14:38:07,604 WARNING mlxd.engine: MLX's CPU backend uses its reference BLAS (MLXD_CPU_BLAS=reference): prompts are ~15x slower; fix: install OpenBLAS
2026-11-25 14:38:21,334 INFO mlxd.engine.core.worker: loaded smollm2 in 7.4s (MLX active 94 MiB)
"""


@pytest.mark.parametrize("text, fast, float32, load_s, blas_start", [
    (LOG_FAST, True, True, 10.3, "MLX's CPU backend uses openblas (system)"),
    (LOG_REFERENCE, False, False, 7.4, "MLX's CPU backend uses its reference BLAS"),
    ("", False, False, None, None),  # nothing logged yet
])
def test_parse_engine_log(text, fast, float32, load_s, blas_start):
    got = cp.parse_engine_log(text)
    assert (got["blas_fast"], got["float32"], got["load_s"]) == (fast, float32, load_s)
    assert got["blas_log"] is None if blas_start is None else got["blas_log"].startswith(blas_start)


# --- the prompts --------------------------------------------------------------------------------------

def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("n", [32, 48, 512, 2000])
def test_prefill_prompt_fits_the_token_count_and_is_deterministic(n):
    text = cp.prefill_prompt(3, n, words)
    assert n - 16 <= words(text) <= n  # one more sentence would overshoot
    assert cp.prefill_prompt(3, n, words) == text


def test_a_prompt_has_one_sentence_at_least():
    assert cp.prefill_prompt(3, 1, words).splitlines()[1].startswith("1. ")


def test_prefill_prompts_of_a_run_differ_from_their_first_word_on():
    firsts = {cp.prefill_prompt(k, 64, words).split()[1] for k in range(-1, 20)}
    assert len(firsts) == 21


def test_long_messages_are_a_long_system_prompt_and_a_question():
    msgs = cp.long_messages(0, 2000, words)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert 1900 <= words(msgs[0]["content"]) <= 1960
    assert cp.long_messages(1, 2000, words)[0]["content"] != msgs[0]["content"]


# --- summary, comparison, goals, table, the suite's figures ---------------------------------------------

def arm_run(name, prefill, decode, long=None):
    r = cp.ArmRun(cp.ARMS[name], server=None, home=Path("/nowhere"), way=None)
    r.prefill = [{"round": i, "prefill_tok_s": v, "ttft_s": 512 / v, "prompt_tokens": 512,
                  "cached_prompt_tokens": 0, "background_cores": 0.1} for i, v in enumerate(prefill)]
    r.decode = [{"round": i, "decode_tok_s": v, "engine_cpu_s_per_token": 1 / v, "engine_cores": 1.0,
                 "completion_tokens": 128, "background_cores": 0.1} for i, v in enumerate(decode)]
    r.long = long
    return r


def runs(after_prefill=(150.0, 160.0, 140.0), after_decode=(12.5, 13.0, 11.0), long_status=200):
    long = {"status": long_status, "answered_by_engine": long_status == 200, "time_s": 20.0, "prompt_tokens": 2010,
            "health_not_ok": [], "error_code": None if long_status == 200 else "engine_stuck"}
    return {"before": arm_run("before", [8.0, 10.0, 8.0], [6.0, 6.5, 6.0]),
            "blas-only": arm_run("blas-only", [8.5, 8.0, 9.0], [6.2, 6.5, 6.4]),
            "after": arm_run("after", list(after_prefill), list(after_decode), long)}


def test_summary_and_paired_comparison():
    rs = runs()
    summ = cp.summarize(rs)
    assert summ["after"]["prefill_tok_s_median"] == 150.0 and summ["after"]["decode_tok_s_median"] == 12.5
    comp = cp.compare(rs, summ)
    assert "before" not in comp
    assert comp["after"]["prefill_tok_s_ratio"] == pytest.approx(150.0 / 8.0)
    assert comp["after"]["prefill_tok_s_ratio_paired"] == pytest.approx(17.5)  # rounds 18.75, 16, 17.5
    assert comp["after"]["decode_tok_s_ratio_paired"] == pytest.approx(2.0)  # 2.08, 2.0, 1.83


@pytest.mark.parametrize("prefill, decode, status, met", [
    ((150.0,), (12.5,), 200, [True, True, True]),
    ((119.0,), (12.5,), 200, [False, True, True]),
    ((150.0,), (11.9,), 503, [True, False, False]),
])
def test_goals(prefill, decode, status, met):
    rs = runs(prefill, decode, status)
    gs = cp.goals(cp.summarize(rs), rs)
    assert [g["met"] for g in gs] == met


def doc_of(rs, profile=()):
    summ = cp.summarize(rs)
    res = {"arms": {n: {"engine": {"blas_log": "MLX's CPU backend uses openblas (system) (/x.so)", "float32": n ==
                                   "after", "mlx_active_mib": 513.0}, "long": r.long, "prefill": r.prefill,
                        "decode": r.decode} for n, r in rs.items()},
           "summary": summ, "comparison": cp.compare(rs, summ), "goals": cp.goals(summ, rs), "profile": list(profile),
           "decode_limit": cp.decode_limit(list(profile), summ), "notes": []}
    info = {"date": "d", "platform": "Linux", "cpu_count": 2, "cpu": "EPYC", "python": "3.11", "mlx": "0.32",
            "mlx_device": "Device(cpu, 0)", "mlx_lm": "0.32.2"}
    settings = {"quick": False, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "rounds": 3, "prompt_tokens": 512,
                "max_tokens": 128, "goals": {"prefill_tok_s": 120.0, "decode_tok_s": 12.0}}
    return {"machine": info, "settings": settings, "results": res}


PROFILE = {"label": "float32, OpenBLAS threads as configured", "blas": "openblas (system)", "step_ms": 120.0,
           "tok_s": 8.3, "step_cores": 1.7, "lm_head_ms": 16.0, "lm_head_share": 0.13, "layers": 30,
           "layers_ms": 100.0, "layers_share": 0.83, "tied_embeddings": True, "bytes_per_token": 538_000_000,
           "achieved_read_gb_s": 4.5, "memory_read_gb_s": 15.7, "memory_read_threads": 2, "blas_gemv_gb_s": 6.0,
           "blas_gemv_nn_gb_s": 12.0, "bandwidth_bound_tok_s": 29.2, "blas_gemv_bound_tok_s": 11.1}


@pytest.mark.parametrize("achieved, limit", [
    (4.5, "Limit: the BLAS's matrix-vector speed"),  # near what the BLAS gives x @ W.T, far from memory
    (12.0, "Limit: memory bandwidth"),
    (2.0, "Limit: per-op work beyond the matmuls"),
])
def test_what_limits_decode(achieved, limit):
    assert limit in cp.decode_limit([{**PROFILE, "achieved_read_gb_s": achieved}], {})


def test_what_limits_decode_names_the_slower_thread_setting_and_needs_a_profile():
    slow = {**PROFILE, "label": "float32, OPENBLAS_NUM_THREADS=1", "step_ms": 200.0, "tok_s": 5.0}
    text = cp.decode_limit([slow, PROFILE], {})
    assert "at best (float32, OpenBLAS threads as configured)" in text
    assert "with OPENBLAS_NUM_THREADS=1 a step took 200 ms" in text
    assert cp.decode_limit([], {}) == ""
    assert "1.50 cores busy" in cp.decode_limit([], {"after": {"decode_engine_cores_median": 1.5}})


def test_markdown():
    md = cp.markdown(doc_of(runs(), [PROFILE]))
    assert "| after | openblas (system) | float32, 513 MiB | 150.0 (140.0–160.0) | **18.75×** (paired 17.50) |" in md
    assert "| before | openblas (system) | as stored (Q4_1), 513 MiB | 8.0 (8.0–10.0) | 1.00 |" in md
    assert "200 in 20.0 s (2010 tok)" in md and "| not run |" in md
    assert "after: prefill ≥ 120 tok/s: MET" in md and "the ~2,000-token prompt answered 200 by the engine: MET" in md
    assert "What limits decode: " in md
    assert "| float32, OpenBLAS threads as configured (openblas (system)) | 120.0 | 8.3 | 1.70 |" in md


def test_suite_figures_report_after_and_blas_only_against_before():
    figs = suite.cpu_figures(doc_of(runs()))
    by = {f.what: f for f in figs}
    pre = by["prefill tok/s, after: OpenBLAS + float32"]
    assert (pre.value, pre.anchor_value, pre.met) == (150.0, 8.0, True)
    assert pre.ratio == pytest.approx(17.5)  # the paired ratio
    assert by["decode tok/s, after: OpenBLAS + float32"].met is True
    assert by["prefill tok/s, OpenBLAS alone, Q4_1"].met is None  # a comparison, no goal
    long = by["2010-token prompt, after: HTTP 200"]
    assert long.met is True and long.value == 20.0
    stuck = {f.what: f for f in suite.cpu_figures(doc_of(runs(long_status=503)))}
    assert stuck["2010-token prompt, after: HTTP 503"].met is False


# --- the benchmark, run on the real default model -----------------------------------------------------

@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arm, log", [("after-stored", "CPU weights: as stored"),
                                      ("after-split", "CPU weights: transposed, ")])
def test_a_layout_arm_s_engine_loads_that_layout_and_answers(tmp_path, arm, log):
    """The arm's engine (started as the benchmark starts it) says in its log
    that it loaded the arm's layout, not the engine's own, and answers."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the fast CPU path is Linux's (MLX's CPU backend)")
    if not fast_path_here()["fast"]:
        pytest.skip("no fast BLAS here: the engine loads the weights as stored, whatever the arm")
    gguf = real_default_model()
    run = cp.start_arm(cp.ARMS[arm], gguf, tmp_path)
    try:
        run.server.wait_ready(240)
        x = cp.run_decode(run, "Story 1. " + cp.STORY, 4, 0, 120)
        assert x["completion_tokens"] >= 1
        text = run.server.log_path.read_text(errors="replace")
        line = next((ln for ln in text.splitlines() if "CPU weights: " in ln), "")
        assert log in line, text[-2000:]
        if arm == "after-split":
            cores = len(os.sched_getaffinity(0))
            assert ("column blocks" in line) == (cores >= 2), line
    finally:
        run.way.close()
        run.server.stop()


def fast_path_here() -> dict:
    """What engine/cpu/fast_blas.py's activate() picks on this machine (a fresh
    process: this one's choice was made by conftest)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLXD_CPU_BLAS", "OPENBLAS_NUM_THREADS")}
    code = ("import json; from mlxd.engine.cpu.fast_blas import activate; c = activate(); "
            "print(json.dumps({'name': c.name, 'fast': c.fast}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.timeout(480)
def test_benchmark_runs_before_and_after_on_the_real_default_model(tmp_path):
    """The smallest run (~50 s on 2 idle cores): one round of short prompts
    per arm; the ~2,000-token prompt on 'after' only (on the reference BLAS
    it takes minutes). Other programs busy on the same cores slow OpenBLAS's
    threads several-fold: hence the generous timeout."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the fast CPU path is Linux's (MLX's CPU backend)")
    gguf = real_default_model()
    out = tmp_path / "cpu_path.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MLXD_CPU_BLAS", "OPENBLAS_NUM_THREADS")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cpu_path.py"), "--quick", "--gguf", str(gguf), "--warmup", "0",
         "--arms", "before,after",
         "--prompt-tokens", "32", "--max-tokens", "4", "--long-tokens", "2000", "--long-arms", "after",
         "--long-max-tokens", "4", "--no-profile", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=450)
    assert out.is_file(), f"no results (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    arms = doc["results"]["arms"]
    summary = doc["results"]["summary"]
    assert list(arms) == ["before", "after"]  # blas-only is the same engine start again: left to the table tests
    for name, arm in arms.items():
        st = summary[name]
        assert not arm["errors"], (name, arm["errors"])
        for key in ("prefill_tok_s_median", "decode_tok_s_median", "decode_cpu_s_per_token_median"):
            assert st.get(key) is not None and math.isfinite(st[key]) and st[key] > 0, (name, key, st)
        assert st["cached_prompt_tokens_max"] == 0  # every prompt prefilled in full
        assert arm["engine"]["blas_log"], f"{name}: no BLAS line in the engine's log"
    here = fast_path_here()
    assert arms["before"]["engine"]["blas_fast"] is False and arms["before"]["engine"]["float32"] is False
    after = arms["after"]["engine"]
    if here["fast"]:
        assert after["blas_fast"] is True and here["name"] in after["blas_log"], after
        assert after["float32"] is True, after
    else:
        assert after["blas_fast"] is False and after["float32"] is False, after  # no fast BLAS: as stored
    for name, arm in arms.items():
        if arm["long"] is None:
            continue
        long = arm["long"]
        assert long["status"] == 200 and long["answered_by_engine"], (name, long)
        assert long["prompt_tokens"] >= 1900, long
        assert long["health_not_ok"] == [], (name, long["health_not_ok"])  # never looked stuck
    assert arms["after"]["long"] is not None
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| after |" in proc.stdout
