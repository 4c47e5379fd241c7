"""The CPU float32 path keeps Linear weights transposed (engine/cpu_linear.py):
the model computes what it did, every plain Linear is replaced, and code that
reads a layer's `weight` still sees the stored orientation."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from mlxd.engine.cpu_linear import TransposedEmbedding, TransposedLinear, transpose_linears


def tiny_llama(tied: bool) -> nn.Module:
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                           tie_word_embeddings=tied)
    mx.random.seed(7)
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("bias", [False, True])
def test_a_transposed_layer_computes_the_same_product(bias):
    mx.random.seed(3)
    linear = nn.Linear(24, 40, bias=bias)
    x = mx.random.normal((3, 5, 24))
    holder = nn.Module()
    holder.proj = linear
    assert transpose_linears(holder) == 1
    layer = holder.proj
    assert isinstance(layer, TransposedLinear)
    assert layer.weight.shape == linear.weight.shape == (40, 24)
    assert mx.allclose(layer(x), linear(x), atol=1e-5).item()


def test_an_embedding_looks_up_and_projects_as_before():
    mx.random.seed(5)
    table = nn.Embedding(50, 16)
    holder = nn.Module()
    holder.embed = table
    ids = mx.array([[3, 0, 49], [7, 7, 1]])
    x = mx.random.normal((2, 16))
    looked_up, projected = table(ids), table.as_linear(x)
    assert transpose_linears(holder) == 1
    assert isinstance(holder.embed, TransposedEmbedding)
    assert holder.embed.weight.shape == (50, 16)
    assert mx.array_equal(holder.embed(ids), looked_up).item()
    assert mx.allclose(holder.embed.as_linear(x), projected, atol=1e-5).item()


@pytest.mark.parametrize("tied, layers", [(False, 2 * 7 + 2), (True, 2 * 7 + 1)])  # q k v o gate up down, embedding (+ lm_head)
def test_a_model_gives_the_same_logits_with_every_layer_transposed(tied, layers):
    model = tiny_llama(tied)
    tokens = mx.array([[5, 17, 3, 88, 41, 2, 9]])
    before = model(tokens)
    assert transpose_linears(model) == layers
    assert not any(type(m) in (nn.Linear, nn.Embedding) for _, m in model.named_modules())
    after = model(tokens)
    assert mx.allclose(before, after, atol=1e-4).item()
    assert transpose_linears(model) == 0  # a second pass finds nothing left to do
