"""bench/one_row_products.py (OpenBLAS's sgemm against its sgemv for a
decoded token's products): its pure parts as tables, and one small run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit import ROOT, load_bench

orp = load_bench("one_row_products")
MIB = 2**20


@pytest.mark.parametrize("weight_bytes, expected", [
    (64 * MIB, 2),          # as big as the cycle: still two copies, so no call reads what the last one left
    (108 * MIB, 2),         # the output head
    (3.375 * MIB, 19),      # an MLP projection: 64 MiB / 3.375 MiB, rounded up
    (1, 64),                # tiny: capped
])
def test_enough_copies_to_read_from_memory(weight_bytes, expected):
    assert orp.copies_for(int(weight_bytes)) == expected


@pytest.mark.parametrize("weight_bytes, expected", [(400 * MIB, 3), (108 * MIB, 3), (4 * MIB, 100)])
def test_calls_read_about_400_mib(weight_bytes, expected):
    assert orp.calls_for(weight_bytes) == expected


def test_the_table_gives_the_sgemv_gain_over_sgemm():
    rows = [{"name": "gate", "inputs": 576, "outputs": 1536,
             "gb_s": {"sgemm": 5.0, "sgemv, in x out": 12.5, "sgemv, out x in": 7.5}}]
    lines = orp.table(rows)
    assert lines[2] == "| gate (576 x 1536) | 3.4 MiB | 5.0 | 12.5 | 7.5 | 2.50x |"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the scipy-openblas32 wheel is a Linux dependency")
def test_a_small_run_checks_every_way_and_writes_its_results(tmp_path):
    out = tmp_path / "orp.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "one_row_products.py"), "--shapes", "64x48,40x300",
                           "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [(r["inputs"], r["outputs"]) for r in doc["rows"]] == [(64, 48), (40, 300)]
    assert all(v > 0 for r in doc["rows"] for v in r["gb_s"].values()) and doc["threads"] == 1
    assert "| 64x48 (64 x 48) |" in proc.stdout


def test_bad_shapes_are_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "one_row_products.py"), "--shapes", "64by48"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "INxOUT" in proc.stderr
