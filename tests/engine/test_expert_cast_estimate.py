"""The heavy-model estimate counts what the CPU backend's load casts: the
zoo's bf16 mixture-of-experts models, whose SwitchLinear experts become
float32 there (gather_mm runs float32 only: engine/cpu/backend_ops.py), are
estimated larger on the CPU by their experts' stored bytes -- the bytes the
real cast adds, measured on the model mlx-lm builds -- and a budget between
the two estimates refuses them there. No engine process is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.config_loading import parse_config
from mlxd.devkit.model_zoo import build_zoo
from mlxd.engine.model.errors import EngineError
from mlxd.engine.model.model_registry import ModelRegistry
from mlxd.moe_expert_bytes import EXPERTS_AS_FLOAT32, read_float16_expert_bytes

MOE_MODELS = ["qwen3_moe", "qwen3_next", "glm4_moe", "deepseek_v3", "gpt_oss", "nemotron_h", "granitemoehybrid"]
ROOMY = 2**40  # a budget every zoo model fits, even as float32 whole


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_zoo(tmp_path_factory.mktemp("zoo"), MOE_MODELS + ["qwen3"])


def registry(folder: Path, tmp_path: Path, budget: int, *, on_cpu: bool, cpu_float32: bool = False) -> ModelRegistry:
    # No embedding model beside it: its room would hide the zoo model's own size (models.with_encoder).
    config = parse_config({"models": {"m": {"path": str(folder)}}, "embeddings": {}}, tmp_path, "mlxd.toml")
    return ModelRegistry(config, budget, cpu_float32=cpu_float32, on_cpu=on_cpu)


def cast_bytes(folder: Path) -> int:
    """What the CPU's weights plan casts, as float32 bytes, on the model mlx-lm builds (lazily: nothing is read)."""
    from mlx_lm.utils import load_model

    from mlxd.engine.cpu.backend_ops import cast_modules, model_ops, weights_plan

    model, _ = load_model(folder, lazy=True)
    plan = weights_plan("cpu", model_ops(model), whole_float32=False)
    return cast_modules(model, plan.cast_ops) if plan.cast_ops else 0


@pytest.mark.parametrize("name", MOE_MODELS)
def test_the_cpu_estimate_grows_by_what_the_cast_adds(zoo, tmp_path, name):
    stored = registry(zoo[name], tmp_path, ROOMY, on_cpu=False).info("m").footprint
    on_cpu = registry(zoo[name], tmp_path, ROOMY, on_cpu=True).info("m").footprint
    experts = read_float16_expert_bytes(zoo[name])
    assert experts and experts == cast_bytes(zoo[name]) // 2  # bf16 -> float32: the cast adds the stored bytes
    assert on_cpu.weights_bytes == stored.weights_bytes + experts and on_cpu.kv_bytes == stored.kv_bytes
    assert EXPERTS_AS_FLOAT32 in on_cpu.source and EXPERTS_AS_FLOAT32 not in stored.source


def test_a_dense_model_is_estimated_alike_on_the_cpu(zoo, tmp_path):
    stored = registry(zoo["qwen3"], tmp_path, ROOMY, on_cpu=False).info("m").footprint
    assert registry(zoo["qwen3"], tmp_path, ROOMY, on_cpu=True).info("m").footprint == stored
    assert cast_bytes(zoo["qwen3"]) == 0


def test_a_model_float32_whole_counts_its_experts_once(zoo, tmp_path):
    """The fast CPU path loads everything as float32 (parameters x 4): no growth on top."""
    info = registry(zoo["qwen3_moe"], tmp_path, ROOMY, on_cpu=True, cpu_float32=True).info("m")
    assert info.weights_dtype == "float32" and EXPERTS_AS_FLOAT32 not in info.footprint.source


def test_a_budget_between_the_estimates_refuses_the_model_on_the_cpu_only(zoo, tmp_path):
    stored = registry(zoo["qwen3_moe"], tmp_path, ROOMY, on_cpu=False).info("m").footprint.total_bytes
    cast = registry(zoo["qwen3_moe"], tmp_path, ROOMY, on_cpu=True).info("m").footprint.total_bytes
    between = (stored + cast) // 2
    registry(zoo["qwen3_moe"], tmp_path, between, on_cpu=False).check_allowed("m")  # a GPU: as stored, it fits
    with pytest.raises(EngineError) as refused:
        registry(zoo["qwen3_moe"], tmp_path, between, on_cpu=True).check_allowed("m")
    assert refused.value.code == "model_too_large" and EXPERTS_AS_FLOAT32 in refused.value.message


def test_the_cpu_float32_verdict_reads_the_model_own_bytes_not_the_embedding_model_beside_it(zoo, tmp_path):
    """A bf16 model is "float32 already" only by its own stored bytes: the
    room kept for an embedding model beside it (added to its footprint) must
    not make a small model miss the CPU's float32 path."""
    import json
    import struct

    encoder = tmp_path / "encoder"
    encoder.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**28], "data_offsets": [0, 2**30]}}).encode()
    (encoder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)  # 1 GiB, by its header
    config = parse_config({"models": {"m": {"path": str(zoo["qwen3"])}}, "embeddings": {"e": {"path": str(encoder)}}},
                          tmp_path, "mlxd.toml")
    info = ModelRegistry(config, ROOMY, cpu_float32=True, on_cpu=True).info("m")
    assert info.footprint.weights_bytes > 2**30  # the encoder's room is counted beside it...
    assert info.weights_dtype == "float32"  # ...and the verdict is the model's own
