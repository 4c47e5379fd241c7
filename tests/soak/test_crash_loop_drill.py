"""The crash-loop drill (bench/crash_loop.py --quick, loaded from that file):
an engine that aborts on every start degrades after exactly loop_crashes
crashes, stays down and quiet through the cool-down while the gateway answers
through the Ollama stand-in, and comes back both by the probation start and
by `mlxd restart engine`. About 45 s."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
# Loaded by path: bench/ is no package.
_spec = importlib.util.spec_from_file_location(
    "mlxd_bench_crash_loop", Path(__file__).resolve().parents[2] / "bench" / "crash_loop.py")
drill = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(drill)
from crash_traffic import GOOD  # noqa: E402  (on sys.path once crash_loop.py is loaded)


@pytest.fixture(scope="module")
def result(demo_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crash-loop")
    out = tmp / "crash_loop.json"
    rc = drill.main(["--quick", "--model", str(demo_models.a), "--home-root", str(tmp), "--out", str(out)])
    data = json.loads(out.read_text())
    return rc, data, tmp


def test_the_drill_meets_every_goal(result):
    rc, data, _ = result
    assert data["figures"]["failures"] == [] and data["passed"]
    assert rc == 0


def test_degraded_after_exactly_the_configured_crashes_with_growing_backoff(result):
    m = result[1]["figures"]
    assert m["loop_crashes"] == result[1]["settings"]["supervisor_documented"]["loop_crashes"]
    assert m["crashes_to_degraded"] == m["loop_crashes"]
    assert m["crash_classes"] == ["sigabrt"]
    assert m["backoffs_s"] == [0.0, 1.0, 2.0, 4.0, None]  # the documented backoff, then degraded
    assert m["spawns_to_degraded"] == m["loop_crashes"] - 1  # the first crash was the running engine's


def test_the_cool_down_spawns_nothing_and_stays_idle(result):
    m = result[1]["figures"]
    assert m["spawns_during_cooldown"] == 0 and m["crashes_during_cooldown"] == 0
    assert m["modes_during_cooldown"] == ["degraded"] and m["status_overall_degraded"] == "degraded"
    assert m["cooldown_window_s"] > 8
    assert {"supervisord", "listener"} <= set(m["cpu_by_process_s"])
    assert m["cpu_watched_pct_of_core"] < 2.0


def test_every_request_while_degraded_is_answered_by_the_fallback(result):
    m = result[1]["figures"]
    assert m["fallback_sent"] == 6 and m["fallback_answered"] == 6 and m["fallback_failed"] == 0
    for r in result[1]["raw"]["cooldown"]["requests"]:
        assert r["backend"] == "ollama" and r["outcome"] in GOOD, r


def test_the_engine_serves_again_after_the_probation_start_and_after_an_operator_restart(result):
    m = result[1]["figures"]
    p, o = m["probation"], m["operator"]
    assert p["healthy_s"] is not None and p["answered_by_engine"] and p["crashes_after"] == 0
    assert p["mode_after"] == "running" and p["probation"] is True
    assert o["crashes_to_degraded"] == 1  # a crash in probation degrades at once
    assert o["command_rc"] == 0 and o["answered_by_engine"]
    assert o["mode_after"] == "running" and o["crash_history_after"] == 0 and o["probation"] is False


def test_the_temp_home_is_removed(result):
    assert not list(result[2].glob("mlxd-soak-*"))
