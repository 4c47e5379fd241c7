"""The fast CPU path's decisions and the prefill's pace, as tables (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.engine.cpu.fast_blas import blas_plan, blas_threads, weights_dtype_on_cpu
from mlxd.engine.model.faults import FaultInjector, parse_faults
from mlxd.engine.model.prefill_pace import PrefillPace, default_step_size

GIB = 2**30


def test_the_first_step_is_small_until_the_speed_is_known():
    pace = PrefillPace(ceiling=512, step_budget_s=5.0)
    assert pace.step() == 32
    assert PrefillPace(ceiling=16, step_budget_s=5.0).step() == 16  # never above the ceiling


@pytest.mark.parametrize("tokens, seconds, last_step, want", [
    (32, 4.0, 32, 32),      # 8 tok/s (reference BLAS, 2 cores): 40 fit in 5 s -> 32
    (32, 0.2, 32, 128),     # 160 tok/s: 800 fit, but growth is at most 4x a step
    (128, 0.8, 128, 512),   # 160 tok/s again: 800 fit, capped at the ceiling
    (32, 0.001, 32, 128),   # a GPU: the ceiling within a few steps, 4x at a time
    (32, 60.0, 32, 16),     # slower than anything: the floor
])
def test_each_step_fits_its_budget_at_the_last_speed(tokens, seconds, last_step, want):
    pace = PrefillPace(ceiling=512, step_budget_s=5.0)
    pace.observe(tokens, seconds)
    assert pace.step() == want


def test_the_pace_follows_a_slowing_prefill_down():
    pace = PrefillPace(ceiling=512, step_budget_s=1.0)
    pace.observe(32, 0.05)   # 640 tok/s
    pace.observe(128, 0.1)   # 1280 tok/s
    assert pace.step() == 512
    pace.observe(512, 4.0)   # attention over a long context: 128 tok/s
    assert pace.step() == 128
    pace.observe(0, 1.0)     # nothing measured: ignored
    assert pace.step() == 128


def test_a_prompt_remainder_does_not_shrink_the_next_prompt_steps():
    pace = PrefillPace(ceiling=512, step_budget_s=1.0)
    pace.observe(32, 0.001)   # a GPU
    pace.observe(128, 0.004)
    assert pace.step() == 512
    pace.observe(7, 0.001)    # the prompt's last few tokens
    assert pace.step() == 512  # the next prompt starts where this one got to


@pytest.mark.parametrize("allowed, stored_dtype, stored, params, budget, want", [
    (True, None, 98_000_000, 135_000_000, 18 * GIB, "float32"),     # the default model, Q4_1 GGUF
    (True, "bfloat16", 270_000_000, 135_000_000, 18 * GIB, "float32"),
    (True, "float32", 540_000_000, 135_000_000, 18 * GIB, None),    # float32 already
    (True, None, 540_000_000, 135_000_000, 18 * GIB, None),         # as big as float32: float32 already
    (True, None, 4_500_000_000, 8_000_000_000, 18 * GIB, None),     # 32 GB as float32: over a quarter
    (True, None, 98_000_000, 135_000_000, 2 * GIB, None),           # 540 MB > a quarter of 2 GiB
    (False, None, 98_000_000, 135_000_000, 18 * GIB, None),         # a GPU, no fast BLAS, or turned off
    (True, None, None, 135_000_000, 18 * GIB, None),                # sizes unknown: as stored
    (True, None, 98_000_000, None, 18 * GIB, None),
])
def test_small_models_load_as_float32_on_a_fast_cpu(allowed, stored_dtype, stored, params, budget, want):
    assert weights_dtype_on_cpu(allowed, stored_dtype, stored, params, budget) == want


@pytest.mark.parametrize("platform, opted_out, mlx_loaded, shim, want_names, why", [
    ("linux", False, False, Path("/v/lib/mlxd/libmlxd_blas-0123456789ab.so"),
     ["openblas (scipy-openblas32 wheel)", "openblas (system)", "openblas (system)"], "no OpenBLAS found"),
    ("linux", False, False, None, ["openblas (system)", "openblas (system)"], "no OpenBLAS found"),
    ("linux", True, False, Path("/s.so"), [], "MLXD_CPU_BLAS=reference"),
    ("linux", False, True, Path("/s.so"), [], "mlx was imported before the BLAS could be loaded"),
    ("darwin", False, False, Path("/s.so"), [], "not Linux: MLX's own BLAS (Accelerate on macOS)"),
])
def test_the_blas_plan(platform, opted_out, mlx_loaded, shim, want_names, why):
    plan, why_not = blas_plan(platform, opted_out, mlx_loaded, shim)
    assert [name for name, _ in plan] == want_names and why_not == why
    if shim is not None and want_names:
        assert plan[0][1] == str(shim)  # the shim comes first: it also sends one-row products to sgemv


@pytest.mark.parametrize("spec, delay_for_100", [("slow@prefill:20", 2.0), ("slow@prefill:5,abort@token:3", 0.5),
                                                  ("abort@token:3", 0.0)])
def test_slow_prefill_fault_delays_each_step_by_tokens(spec, delay_for_100):
    assert FaultInjector(spec, None).prefill_delay_s(100) == pytest.approx(delay_for_100)


@pytest.mark.parametrize("spec", ["slow@token:3", "abort@prefill", "slow@prefill:x", "abort@token:3/twice"])
def test_slow_goes_with_prefill_only(spec):
    with pytest.raises(ValueError):
        parse_faults(spec)


def test_a_once_fault_removes_its_file_as_it_fires(tmp_path):
    fault_file = tmp_path / "fault"
    fault_file.write_text("raise@token:2/once")
    faults = FaultInjector(None, str(fault_file))
    faults.refresh()
    faults.check("token", 1)  # not yet
    assert fault_file.exists()
    with pytest.raises(RuntimeError):
        faults.check("token", 2)
    assert not fault_file.exists() and faults.active == ()
    faults.refresh()
    faults.check("token", 5)  # gone: the restarted engine serves the retry


@pytest.mark.parametrize("cores, configured, want", [(2, None, "1"), (1, None, "1"), (16, None, "8"),
                                                     (2, "2", "2"), (16, "", "8")])
def test_openblas_gets_half_the_cores_unless_told(cores, configured, want):
    assert blas_threads(cores, configured) == want


@pytest.mark.parametrize("configured, on_cuda, want", [
    (None, False, 512),    # a Mac's GPU, the CPU: a joining chunk keeps the decoding rows' steps short
    (None, True, 2048),    # MLX's CUDA backend: a turn's chunk in one step, one cuDNN graph to build
    (1024, True, 1024),    # as configured, on any backend
    (256, False, 256),
])
def test_the_default_step_size_by_backend(configured, on_cuda, want):
    assert default_step_size(configured, on_cuda) == want
