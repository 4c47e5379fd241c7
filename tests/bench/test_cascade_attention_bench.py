"""bench/cascade_attention.py (a decode step's attention over a shared
prefix: cascade against per-row attention): its KV figures, and one small run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit import ROOT, load_bench

pytest.importorskip("mlx.core")
ca = load_bench("cascade_attention")


def test_the_goal_shape_reads_the_prefix_once_shared():
    goal = ca.SHAPES["goal"]
    token = 2 * goal.kv_heads * goal.head_dim * 2  # K and V of one position of one layer, bf16
    assert goal.kv_bytes(2, shared=True) == (12288 + 20480) * token
    assert goal.kv_bytes(2, shared=False) == (4 * 12288 + 20480) * token


def test_a_small_run_checks_every_arm_and_writes_its_results(tmp_path):
    out = tmp_path / "ca.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cascade_attention.py"), "--shape", "tiny",
                           "--queries", "1,3", "--dtype", "float32", "--layers", "1", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [r["queries_a_row"] for r in doc["results"]] == [1, 3]
    for r in doc["results"]:
        assert list(r["arms"]) == list(ca.ARMS)
        assert all(a["step_s"] > 0 and a["worst_diff"] <= 1e-5 for a in r["arms"].values())
    assert "| cascade explicit |" in proc.stdout


def test_an_unknown_shape_is_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cascade_attention.py"), "--shape", "huge"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown huge" in proc.stderr
