"""The CPU float32 path keeps Linear weights transposed where they widen
and a prompt's rows on two CPU streams (engine/cpu/cpu_linear.py): the model
computes what it did, every plain Linear is replaced, and code that reads a
layer's `weight` still sees the stored orientation. The layouts kept only to
compare (split, stored) are bench/cpu_arms.py's: tests/bench/test_cpu_arms.py."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxd.engine.cpu import cpu_linear
from mlxd.engine.cpu.cpu_linear import TransposedEmbedding, TransposedLinear, prompt_streams, transpose_linears
from tiny_models import tiny_llama



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


@pytest.mark.parametrize("tied, layers", [
    (False, 2 * 4 + 2),  # q o gate up (k, v and down narrow: as stored), embedding, lm_head
    (True, 2 * 4 + 1),
])
def test_a_model_gives_the_same_logits_with_its_layers_transposed(tied, layers):
    model = tiny_llama(tied)
    tokens = mx.array([[5, 17, 3, 88, 41, 2, 9]])
    before = model(tokens)
    assert transpose_linears(model) == layers
    assert not any(type(m) is nn.Linear for _, m in model.named_modules())
    stored = [m["weight"].shape for _, m in model.named_modules() if type(m) is cpu_linear.StoredLinear]
    assert all(outputs < inputs for outputs, inputs in stored) and len(stored) == 2 * 7 - (layers - 2 + tied)
    assert not any(type(m) is nn.Embedding for _, m in model.named_modules())
    after = model(tokens)
    assert mx.allclose(before, after, atol=1e-4).item()
    assert transpose_linears(model) == 0  # a second pass finds nothing left to do


@pytest.mark.parametrize("inputs, outputs, expected", [
    (576, 1536, True),    # widens: transposed (sgemv reads it faster so, docs/BENCHMARKS.md)
    (576, 576, True),     # square: the same either way
    (576, 49152, True),   # a tied output head
    (1536, 576, False),   # narrows (an MLP's down projection): as stored
    (576, 192, False),
])
def test_only_the_layers_that_widen_are_transposed(inputs, outputs, expected):
    assert cpu_linear.transposes(inputs, outputs) == expected


@pytest.mark.parametrize("bias", [False, True])
def test_a_shared_input_product_serves_each_layer_once_per_input(bias):
    mx.random.seed(3)
    q, k, v = nn.Linear(64, 64, bias=bias), nn.Linear(64, 32, bias=bias), nn.Linear(64, 32, bias=bias)
    mx.eval(q.parameters(), k.parameters(), v.parameters())
    x = mx.random.normal((1, 5, 64))
    expected = [q(x), k(x), v(x)]
    shared = cpu_linear.SharedInputProduct([cpu_linear.TransposedLinear(q["weight"].T[None], q.get("bias")), k, v])
    layers = [shared.layer(i) for i in range(3)]
    assert [m.weight.shape for m in layers] == [(64, 64), (32, 64), (32, 64)]
    first = layers[0](x)
    product = shared._last[1]  # held for the next layers of the same input
    got = [first, layers[1](x), layers[2](x)]
    assert shared._last is None  # the last layer lets the product go
    for a, b in zip(got, expected):
        assert mx.allclose(a, b, atol=1e-5).item()
    assert layers[1](x) is not None and shared._last[1] is not product  # a new call: a new product
    assert mx.allclose(layers[2](x * 2), v(x * 2), atol=1e-5).item()  # another input: its own product


@pytest.mark.parametrize("cores, expected", [
    (2, 2),     # a prompt's rows on a stream per core
    (16, 2),    # at most MAX_PROMPT_STREAMS
    (1, 1),     # one core: one stream
    (0, 1),
])
def test_a_prompts_rows_go_on_a_stream_per_core_at_most_two(cores, expected):
    assert prompt_streams(cores) == expected


@pytest.mark.parametrize("rows, streams", [(64, 2), (101, 2), (63, 2), (200, 1)])
def test_a_prompts_rows_on_two_streams_give_the_same_logits(rows, streams):
    """64 rows or more (a prompt) are cut over the streams; fewer (a token,
    a batch's decode step) stay on one."""
    model = tiny_llama(True, vocab=97)
    mx.random.seed(5)
    tokens = mx.random.randint(0, 97, (1, rows))
    before = model(tokens)
    transpose_linears(model, streams)
    layers = [m for _, m in model.named_modules() if isinstance(m, (TransposedLinear, cpu_linear.StoredLinear))]
    assert layers and all(m.prompt_streams == streams for m in layers)
    assert mx.allclose(before, model(tokens), atol=1e-4).item()
    x = mx.random.normal((1, rows, 64))
    split = cpu_linear._by_prompt_rows(x, lambda v: v * 2, streams)
    assert split.shape == x.shape and mx.allclose(split, x * 2).item()
