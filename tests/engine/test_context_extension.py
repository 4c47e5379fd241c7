"""A model served past the context it was trained on (engine/model/model_load.py context_extension): a table."""

from __future__ import annotations

import pytest

from mlxd.engine.model.model_load import context_extension

YARN_4X = {"max_position_embeddings": 32768,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                            "mscale": 1.0, "mscale_all_dim": 1.0}}


@pytest.mark.parametrize("config, extend_to, want", [
    ({"max_position_embeddings": 8192}, 32768, YARN_4X),  # the default model: SmolLM2's 8k to 32k
    ({"max_position_embeddings": 8192}, None, {}),  # not asked for
    ({"max_position_embeddings": 32768}, 32768, {}),  # already that long
    ({"max_position_embeddings": 131072}, 32768, {}),  # longer: never shortened
    ({}, 32768, {}),  # the model's own context not known: nothing to scale from
    # a model that scales its RoPE already (Llama 3's scheme, Qwen's YaRN): served as it was trained
    ({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 32768, {}),
    ({"max_position_embeddings": 4096}, 6144, {"max_position_embeddings": 6144, "rope_scaling": {
        "type": "yarn", "factor": 1.5, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}}),
])
def test_context_extension(config, extend_to, want):
    assert context_extension(config, extend_to) == want


def test_mlx_lm_builds_a_yarn_rope_from_it():
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.rope_utils import YarnRoPE

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=32,
                           rope_theta=100000.0, rope_traditional=True, **YARN_4X)
    model = llama.Model(args)
    rope = model.model.layers[0].self_attn.rope
    assert isinstance(rope, YarnRoPE) and rope.mscale == 1.0  # no attention temperature
    out = model(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, 32) and bool(mx.isfinite(out).all())
