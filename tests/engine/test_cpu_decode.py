"""A decoded token in fewer MLX ops on the CPU's float32 path
(engine/cpu/cpu_decode.py): the rotation matrix is RoPE, and a model with the
shortcuts gives the logits it gave without them, token after token, with
mlx-lm's caches and the engine's, taking the shortcut for one token and
MLX's own ops for a prompt or a quantised cache; and prepare_float32, the
path's one entry from the model load. The split layout's MLP chains are
bench/cpu_arms.py's (tests/bench/test_cpu_arms.py)."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxd.engine.cpu import cpu_decode
from mlxd.engine.cpu.cpu_decode import (CompiledRMSNorm, FoldedLlamaAttention, FoldedQwen2Attention, RotationRoPE,
                                        prepare_float32, rotation_matrix, shorten_decode)
from mlxd.engine.cpu.cpu_linear import SharedColumns, StoredLinear, TransposedLinear, transpose_linears
from mlxd.engine.cache.kv_cache import AllocatedKVCache
from tiny_models import decode, tiny


@pytest.mark.parametrize("dims, head_dim, traditional, base, scale, position", [
    (64, 64, False, 10000.0, 1.0, 0),
    (64, 64, False, 100000.0, 1.0, 317),
    (64, 64, True, 10000.0, 1.0, 5),
    (32, 64, False, 10000.0, 1.0, 41),    # partial rotary: the last 32 features pass through
    (16, 16, False, 500000.0, 0.25, 9000),  # linear scaling
])
def test_the_rotation_matrix_is_rope_at_that_position(dims, head_dim, traditional, base, scale, position):
    mx.random.seed(1)
    x = mx.random.normal((1, 3, 1, head_dim))
    expected = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=position)
    rotated = x @ mx.array(rotation_matrix(position, dims, head_dim, base, scale, traditional))
    assert mx.allclose(rotated, expected, atol=1e-4).item()




CACHES = {
    "mlx-lm's KVCache": lambda: KVCache(),
    "the engine's AllocatedKVCache": lambda: AllocatedKVCache(64),
    "a quantised cache (MLX's own ops)": lambda: QuantizedKVCache(group_size=32, bits=8),
}


@pytest.mark.parametrize("arch, folded", [("llama", FoldedLlamaAttention), ("qwen2", FoldedQwen2Attention)])
@pytest.mark.parametrize("cache_kind", list(CACHES))
@pytest.mark.parametrize("intermediate", [256, 512])
def test_decoding_gives_the_same_logits_with_the_shortcuts(arch, folded, cache_kind, intermediate):
    prompt = [5, 17, 3, 88, 41, 2, 9, 60, 33]
    reference = tiny(arch, intermediate=intermediate)
    expected = decode(reference, [CACHES[cache_kind]() for _ in reference.layers], prompt, 12)
    model = tiny(arch, intermediate=intermediate)
    transpose_linears(model)
    # per layer: attention, its RoPE, 2 norms; and the final norm
    assert shorten_decode(model) == 2 * 4 + 1
    layer = model.model.layers[0]
    assert type(layer.self_attn) is folded and isinstance(layer.self_attn.rope, RotationRoPE)
    assert isinstance(layer.input_layernorm, CompiledRMSNorm)
    assert type(layer.mlp) in (llama.MLP, qwen2.MLP)  # mlx-lm's own MLP
    # the narrowing down projection stays as stored, the widening gate and up are transposed
    assert type(layer.mlp.down_proj) is StoredLinear and type(layer.mlp.gate_proj) is TransposedLinear
    assert layer.mlp.down_proj.weight.shape == (128, intermediate)
    # the query, key and value projections are one product, their weights once
    assert type(layer.self_attn.q_proj) is SharedColumns and layer.self_attn.k_proj.weight.shape == (64, 128)
    names = [k for k, _ in tree_flatten(layer.self_attn.parameters())]
    assert not any(k.startswith(("q_proj", "k_proj", "v_proj")) for k in names), names
    got = decode(model, [CACHES[cache_kind]() for _ in model.layers], prompt, 12)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert mx.allclose(a, b, atol=2e-4).item(), f"step {step}: max diff {mx.abs(a - b).max().item()}"


@pytest.mark.parametrize("cores, streams", [(1, 1), (2, 2), (8, 2)])
def test_prepare_float32_lays_the_model_out_whatever_the_environment_says(monkeypatch, cores, streams):
    """The model load's one call: transposed where a layer widens, the
    shortcuts, a prompt's rows on a stream per core (at most 2). No
    environment variable picks another layout (MLXD_CPU_LAYOUT was one)."""
    monkeypatch.setenv("MLXD_CPU_LAYOUT", "stored")
    monkeypatch.setattr(cpu_decode, "usable_cores", lambda: cores)
    prompt = [5, 17, 3, 88, 41, 2, 9, 60, 33]
    reference = tiny("qwen2")
    expected = decode(reference, [KVCache() for _ in reference.layers], prompt, 6)
    model = tiny("qwen2")
    assert prepare_float32(model) == f"transposed, a prompt's rows on {streams} CPU stream(s)"
    layer = model.model.layers[0]
    assert type(layer.self_attn) is FoldedQwen2Attention and type(layer.self_attn.q_proj) is SharedColumns
    assert type(layer.mlp.gate_proj) is TransposedLinear and layer.mlp.gate_proj.prompt_streams == streams
    assert not any(type(m) is nn.Linear for _, m in model.named_modules())
    got = decode(model, [KVCache() for _ in model.layers], prompt, 6)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert mx.allclose(a, b, atol=2e-4).item(), f"step {step}: max diff {mx.abs(a - b).max().item()}"


def ops_in(y: mx.array, path) -> int:
    mx.export_to_dot(str(path), y)
    return len(re.findall(r'label ="', path.read_text()))


def test_a_one_token_step_takes_the_shortcut(tmp_path):
    """A quarter of the ops, or fewer (the default model: 4,247 -> 972)."""
    counts = []
    for shortened in (False, True):
        model = tiny("llama")
        if shortened:
            transpose_linears(model)
            shorten_decode(model)
        cache = [KVCache() for _ in model.layers]
        mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
        counts.append(ops_in(model(mx.array([[7]]), cache=cache), tmp_path / "step.dot"))
    before, after = counts
    assert after * 3 < before, counts
