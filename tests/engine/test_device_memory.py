"""The process's device memory measured from outside (nvidia-smi), and MLX's
limit lowered by what the process holds outside MLX (engine/core/device_memory.py)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from testkit import chat, wait_until

from mlxd.engine.core.device_memory import (DeviceMemory, DeviceMemoryWatch, confirmed_outside, mlx_limit, over_budget,
                                            parse_compute_apps)

GIB = 2**30
MIB = 2**20


@pytest.mark.parametrize("text, expected", [
    ("123, 4096\n", {123: 4096 * MIB}),
    ("123, 100\n123, 50\n7, 1\n", {123: 150 * MIB, 7: 1 * MIB}),  # one process on two GPUs: summed
    ("No running processes found\n", {}),
    ("123, [N/A]\n\n", {}),
    ("", {}),
    ("123, [N/A]\n77, 5\n", {77: 5 * MIB}),
])
def test_nvidia_smi_compute_apps_are_read_per_pid(text, expected):
    assert parse_compute_apps(text) == expected


@pytest.mark.parametrize("budget, outside, expected", [
    (60 * GIB, 0, 60 * GIB),
    (60 * GIB, 4 * GIB, 55 * GIB),  # the H100's CUDA context and workspaces: room left for them, and to grow 25 %
    (60 * GIB, 50 * GIB, 30 * GIB),  # a wild measurement never takes MLX below half the budget
    (60 * GIB, -1 * GIB, 60 * GIB),  # MLX's own count above nvidia-smi's: nothing outside
])
def test_mlx_limit_leaves_room_for_memory_outside_mlx(budget, outside, expected):
    assert mlx_limit(budget, outside) == expected


def test_the_watch_keeps_the_most_confirmed_outside_mlx_and_stops_where_nothing_is_seen():
    readings = iter([3 * GIB, 20 * GIB, 4 * GIB, 5 * GIB, 5 * GIB, 4 * GIB, None])
    watch = DeviceMemoryWatch(1, lambda: 1 * GIB, measure=lambda pid: next(readings), interval_s=0.01)
    watch.start()
    watch.join(10)
    assert not watch.is_alive()  # the None reading ended it
    assert watch.latest is not None
    assert watch.latest.process_bytes == 4 * GIB and watch.latest.mlx_bytes == 1 * GIB
    # 20 - 1 was seen once (a stale nvidia-smi): not confirmed; 5 - 1 twice: the most seen, not the last (3)
    assert watch.latest.outside_bytes == 4 * GIB


@pytest.mark.parametrize("recent, confirmed", [
    ([], 0), ([3 * GIB], 3 * GIB), ([3 * GIB, 19 * GIB], 3 * GIB), ([19 * GIB, 4 * GIB], 4 * GIB),
    ([1, 4 * GIB, 5 * GIB], 4 * GIB), ([-GIB], 0),
])
def test_a_reading_outside_mlx_counts_once_the_next_confirms_it(recent, confirmed):
    assert confirmed_outside(recent) == confirmed


@pytest.mark.parametrize("process, taken_at, trimmed_at, over", [
    (11 * GIB, 5.0, 0.0, True),     # over the budget, seen after the last trim
    (11 * GIB, 5.0, 6.0, False),    # the same measurement: trimmed already
    (10 * GIB, 5.0, 0.0, False),    # at the budget is within it
    (3 * GIB, 5.0, 0.0, False),
])
def test_mlx_cache_given_back_once_a_measurement_over_the_budget(process, taken_at, trimmed_at, over):
    latest = DeviceMemory(process, GIB, process - GIB, taken_at)
    assert over_budget(latest, 10 * GIB, trimmed_at) is over
    assert not over_budget(None, 10 * GIB, 0.0)


def fake_nvidia_smi(folder, mib: int) -> str:
    """A stand-in for nvidia-smi on PATH: it lists its caller (the engine) at `mib` MiB."""
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho \"$PPID, {mib}\"\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


def test_the_engine_lowers_mlx_limit_by_what_nvidia_smi_sees_outside_mlx(start_engine, tmp_path):
    eng = start_engine(env={"PATH": fake_nvidia_smi(tmp_path, 6144)})
    deadline = time.monotonic() + 60
    while True:
        mem = eng.health()["memory"]
        if mem.get("outside_mlx_bytes") and mem["mlx_memory_limit_bytes"] != mem["budget_bytes"]:
            break
        assert time.monotonic() < deadline, mem
        time.sleep(0.2)
    assert mem["device_process_bytes"] == 6 * GIB
    # Outside MLX: nvidia-smi's figure less MLX's active + cached memory (the demo model's weights, a few MiB).
    assert 5.5 * GIB < mem["outside_mlx_bytes"] < 6 * GIB
    assert mem["mlx_memory_limit_bytes"] == mlx_limit(mem["budget_bytes"], mem["outside_mlx_bytes"])
    assert chat(eng.url).status_code == 200  # and it serves as before


def test_a_process_over_its_budget_on_the_device_gives_mlx_cache_back(start_engine, tmp_path):
    """nvidia-smi sees the engine over its budget (buffers freed to CUDA's pool stay the process's): MLX's cache
    is given back, once a measurement, and the engine serves on."""
    budget_total = 4 * GIB  # the budget is a share of it
    eng = start_engine(env={"PATH": fake_nvidia_smi(tmp_path, 6144), "MLXD_MEMORY_TOTAL_BYTES": str(budget_total)})
    assert eng.health()["memory"]["budget_bytes"] < 6 * GIB
    wait_until(lambda: "MLX's buffer cache given back" in eng.log(), 60, what="the cache given back")
    assert chat(eng.url).status_code == 200
