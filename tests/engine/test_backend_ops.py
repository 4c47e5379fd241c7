"""What each op of a model runs in on its backend (engine/cpu/backend_ops.py),
and which MLX errors are a backend's capability limit rather than a device
fault (engine/model/errors.py): tables, then the real ops on this machine."""

from __future__ import annotations

import json

import pytest

from mlxd.engine.model.errors import BACKEND_UNSUPPORTED, backend_limit, backend_unsupported
from mlxd.engine.model.faults import METAL_MESSAGE, InjectedMLXError, backend_limit_record
from mlxd.engine.cpu.backend_ops import WeightsPlan, backend_of, runs_in, weights_plan
from mlxd.supervisor.exit_classes import NOT_EXITS, ExitClass
from mlxd.supervisor.journal import crash_counts, is_evidence, quarantine_verdicts

BF16, F32 = frozenset({"bfloat16"}), frozenset({"float32"})
DENSE = {"matmul": BF16, "take": BF16}
MOE = {**DENSE, "gather_mm": BF16}
QUANTIZED_MOE = {"quantized_matmul": BF16, "gather_qmm": BF16, "take": BF16}
CAST_EXPERTS = ("gather_mm",)


@pytest.mark.parametrize("backend, ops, whole_float32, whole, cast", [
    pytest.param("cpu", DENSE, False, None, (), id="cpu-dense-bf16-as-stored"),
    pytest.param("cpu", DENSE, True, "float32", (), id="cpu-dense-fast-blas-float32-whole"),
    pytest.param("cpu", MOE, False, None, CAST_EXPERTS, id="cpu-moe-bf16-experts-float32-cpu_float32-off"),
    pytest.param("cpu", MOE, True, "float32", (), id="cpu-moe-fast-path-float32-whole-covers-experts"),
    pytest.param("cpu", {**MOE, "gather_mm": F32}, False, None, (), id="cpu-moe-float32-experts-as-stored"),
    pytest.param("cpu", {**MOE, "gather_mm": BF16 | F32}, False, None, CAST_EXPERTS, id="cpu-moe-mixed-experts"),
    pytest.param("cpu", QUANTIZED_MOE, False, None, (), id="cpu-quantized-experts-gather_qmm-runs-bf16-scales"),
    pytest.param("cpu", QUANTIZED_MOE, True, "float32", (), id="cpu-quantized-experts-fast-path-dequantised"),
    pytest.param("gpu", MOE, False, None, (), id="gpu-moe-bf16-as-stored"),
    pytest.param("gpu", DENSE, False, None, (), id="gpu-dense-as-stored"),
])
def test_weights_plan_casts_only_what_the_backend_cannot_run(backend, ops, whole_float32, whole, cast):
    plan = weights_plan(backend, ops, whole_float32)
    assert (plan.whole, plan.cast_ops) == (whole, cast)
    if cast:
        assert "gather_mm" in plan.why and "float32 only" in plan.why


@pytest.mark.parametrize("backend, op, dtype, runs", [
    ("cpu", "gather_mm", "bfloat16", False), ("cpu", "gather_mm", "float16", False),
    ("cpu", "gather_mm", "float32", True), ("cpu", "gather_qmm", "bfloat16", True),
    ("cpu", "matmul", "bfloat16", True), ("gpu", "gather_mm", "bfloat16", True),
])
def test_the_op_table(backend, op, dtype, runs):
    assert runs_in(backend, op, dtype) is runs


def test_the_plan_default_is_as_stored():
    assert weights_plan("cpu", {}, False) == WeightsPlan(None)


@pytest.mark.parametrize("exc, limit", [
    (RuntimeError("[GatherMM::eval] Currently only supports float32."), "[GatherMM::eval] Currently only supports float32."),
    (ValueError("[conv] dtype bfloat16 not supported on this backend"), "[conv] dtype bfloat16 not supported on this backend"),
    (RuntimeError("[Hadamard::eval_cpu] Not implemented for the CPU"), "[Hadamard::eval_cpu] Not implemented for the CPU"),
    (RuntimeError("[SomeOp::eval] bad\nsecond line"), "[SomeOp::eval] bad"),
    (RuntimeError(METAL_MESSAGE), None),
    (InjectedMLXError("[GatherMM::eval] Currently only supports float32."), None),  # ours: a fault injected
    (RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory"), None),
    (RuntimeError("[metal::malloc] Attempting to allocate 9 bytes which is greater than the maximum"), None),
    (RuntimeError("[CUDA] cudaErrorIllegalAddress: not supported"), None),
    (RuntimeError("[broadcast_shapes] Shapes (1,2) and (1,3) cannot be broadcast."), None),
    (NotImplementedError("RotatingKVCache Quantization NYI"), "RotatingKVCache Quantization NYI"),
    (KeyError("not supported"), None),
    (MemoryError(), None),
])
def test_a_backend_limit_is_told_from_a_device_fault(exc, limit):
    assert backend_limit(exc) == limit


@pytest.mark.parametrize("reloading, retry_after, says", [(True, 5, "reloads it with float32"),
                                                          (False, None, "float32 already")])
def test_the_backend_limit_answer(reloading, retry_after, says):
    error = backend_unsupported("moe", "[GatherMM::eval] Currently only supports float32.", reloading)
    assert (error.status, error.code, error.type, error.retry_after) == (500, BACKEND_UNSUPPORTED, "server_error",
                                                                         retry_after)
    assert "GatherMM" in error.message and says in error.message and error.body()["error"]["code"] == BACKEND_UNSUPPORTED


def test_a_backend_limit_line_is_no_crash_and_no_evidence():
    """The engine's journal line: the supervisor's class, not counted as a crash, never quarantining."""
    assert ExitClass(BACKEND_UNSUPPORTED).value in NOT_EXITS
    record = backend_limit_record(1000.0, 7, "moe", "[GatherMM::eval] x", [("r1", "fp1")], True)
    assert record.klass == BACKEND_UNSUPPORTED and record.fingerprints() == {"fp1"}
    assert not record.is_crash and not is_evidence(record)
    assert crash_counts([record, record], 1001.0) == {"last_hour": 0, "last_day": 0}
    assert quarantine_verdicts([record, record], 1001.0, 3600) == ({}, {})


def test_backend_of():
    assert backend_of("Device(cpu, 0)") == "cpu" and backend_of("Device(gpu, 0)") == "gpu"


def test_the_cpu_backend_still_has_the_limits_the_table_says():
    """The table against this MLX: on the CPU backend, gather_mm refuses
    bf16 weights and runs float32 ones; gather_qmm runs bf16 scales. A new
    MLX that lifts a limit fails here, so the table (and the cast) follows."""
    import mlx.core as mx

    if backend_of(mx.default_device()) != "cpu":
        pytest.skip(f"the table is the CPU backend's; this MLX runs on {mx.default_device()}")
    x = mx.ones((1, 1, 1, 64), mx.bfloat16)
    idx = mx.array([[[1, 2]]], dtype=mx.uint32)
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        w = mx.ones((4, 64, 32), dtype)
        name = str(dtype).rpartition(".")[2]
        try:
            mx.eval(mx.gather_mm(x.astype(dtype), w, rhs_indices=idx))
            ran = True
        except (RuntimeError, ValueError) as exc:
            assert backend_limit(exc) is not None, exc
            ran = False
        assert ran is runs_in("cpu", "gather_mm", name), name
    wq, scales, biases = mx.quantize(mx.ones((4, 32, 64)), group_size=32, bits=4)
    mx.eval(mx.gather_qmm(x, wq, scales.astype(mx.bfloat16), biases.astype(mx.bfloat16), rhs_indices=idx,
                          transpose=True, group_size=32, bits=4))


@pytest.mark.parametrize("works, kinds, latent, dequantized", [
    pytest.param(True, [], False, None, id="plain-kv-mlx-lm-quantises"),
    pytest.param(True, ["ArraysCache"], False, None, id="state-space-layers-left-alone"),
    pytest.param(True, ["RotatingKVCache"], False, "RotatingKVCache", id="sliding-window-mlx-lm-would-raise-NYI"),
    pytest.param(False, [], False, "no kernel", id="no-quantised-attention-kernel"),
    pytest.param(None, [], False, "could not be probed", id="shape-not-probed"),
    pytest.param(True, [], True, "latent attention", id="deepseek-mla-reads-arrays"),
])
def test_when_mlxd_quantises_the_kv_itself(works, kinds, latent, dequantized):
    from mlxd.engine.model.model_load import why_decode_dequantized

    why = why_decode_dequantized(works, kinds, latent)
    assert (why is None) if dequantized is None else (dequantized in why), why


def test_a_backend_limit_turns_a_model_to_float32_once(tmp_path):
    """The registry's float32 after a limit: once per model, never for one stored as float32."""
    from mlxd.config_loading import parse_config
    from mlxd.engine.model.model_registry import ModelRegistry, stored_dtype

    assert stored_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert stored_dtype({"torch_dtype": "bfloat16", "quantization": {"bits": 4}}) is None
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                    "intermediate_size": 128, "num_attention_heads": 2,
                                                    "vocab_size": 64, "torch_dtype": "bfloat16"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    registry = ModelRegistry(parse_config({"models": {"m": {"path": str(folder)}}}, tmp_path, "mlxd.toml"), 2**34)
    assert registry.info("m").weights_dtype is None
    assert registry.serve_as_float32("m") is True and registry.info("m").weights_dtype == "float32"
    assert registry.serve_as_float32("m") is False
