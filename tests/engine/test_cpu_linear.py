"""The CPU float32 path keeps Linear weights transposed, wide ones in column
blocks on parallel CPU streams (engine/cpu/cpu_linear.py): the model computes
what it did, every plain Linear is replaced, and code that reads a layer's
`weight` still sees the stored orientation."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from mlxd.engine.cpu import cpu_linear
from mlxd.engine.cpu.cpu_linear import (SPLIT_MIN_OUTPUTS, TransposedEmbedding, TransposedLinear, column_blocks,
                                     cpu_layout, transpose_linears)


def tiny_llama(tied: bool, intermediate: int = 128, vocab: int = 97) -> nn.Module:
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=intermediate,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
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


@pytest.mark.parametrize("tied, blocks, layers", [
    (False, 1, 2 * 4 + 2),  # q o gate up (k, v and down narrow: as stored), embedding, lm_head
    (True, 1, 2 * 4 + 1),
    (False, 2, 2 * 7 + 2),  # split: every layer (the MLP chains take the down projection in row blocks)
    (True, 2, 2 * 7 + 1),
])
def test_a_model_gives_the_same_logits_with_its_layers_transposed(tied, blocks, layers):
    model = tiny_llama(tied)
    tokens = mx.array([[5, 17, 3, 88, 41, 2, 9]])
    before = model(tokens)
    assert transpose_linears(model, blocks) == layers
    assert not any(type(m) is nn.Linear for _, m in model.named_modules())
    stored = [m["weight"].shape for _, m in model.named_modules() if type(m) is cpu_linear.StoredLinear]
    assert all(outputs < inputs for outputs, inputs in stored) and len(stored) == 2 * 7 - (layers - 2 + tied)
    assert not any(type(m) is nn.Embedding for _, m in model.named_modules())
    after = model(tokens)
    assert mx.allclose(before, after, atol=1e-4).item()
    assert transpose_linears(model, blocks) == 0  # a second pass finds nothing left to do


@pytest.mark.parametrize("inputs, outputs, blocks, expected", [
    (576, 1536, 1, True),    # widens: transposed (sgemv reads it 12.7 GB/s against 7.7 as stored)
    (576, 576, 1, True),     # square: the same either way
    (576, 49152, 1, True),   # a tied output head
    (1536, 576, 1, False),   # narrows (an MLP's down projection): as stored, 11.7 against 8.3
    (576, 192, 1, False),
    (1536, 576, 2, True),    # split: every layer, for the MLP's row blocks
])
def test_one_stream_transposes_only_the_layers_that_widen(inputs, outputs, blocks, expected):
    assert cpu_linear.transposes(inputs, outputs, blocks) == expected


@pytest.mark.parametrize("bias", [False, True])
def test_a_shared_input_product_serves_each_layer_once_per_input(bias):
    mx.random.seed(3)
    q, k, v = nn.Linear(64, 64, bias=bias), nn.Linear(64, 32, bias=bias), nn.Linear(64, 32, bias=bias)
    mx.eval(q.parameters(), k.parameters(), v.parameters())
    x = mx.random.normal((1, 5, 64))
    expected = [q(x), k(x), v(x)]
    shared = cpu_linear.SharedInputProduct([cpu_linear.TransposedLinear([q["weight"].T[None]], q.get("bias")), k, v])
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


@pytest.mark.parametrize("setting, cores, expected", [
    (None, 2, (True, 1, 2)),         # the default: transposed, a token on one stream, a prompt's rows on two
    ("", 16, (True, 1, 2)),
    ("split", 2, (True, 2, 1)),      # asked for: a block per core, up to MAX_BLOCKS (a prompt's too)
    ("split", 16, (True, 2, 1)),
    ("split", 1, (True, 1, 1)),      # one core: no stream of its own for a second block
    (None, 1, (True, 1, 1)),
    ("transposed", 8, (True, 1, 2)),
    ("stored", 8, (False, 1, 1)),    # MLX's own layout
    (" Stored ", 2, (False, 1, 1)),
    ("bogus", 2, (True, 1, 2)),      # unknown: the default
])
def test_the_layout_follows_the_setting_and_the_cores(setting, cores, expected):
    assert cpu_layout(setting, cores) == expected


@pytest.mark.parametrize("outputs, blocks, expected", [
    (49152, 2, [(0, 24576), (24576, 49152)]),
    (577, 2, [(0, 288), (288, 577)]),
    (SPLIT_MIN_OUTPUTS, 3, [(0, 170), (170, 341), (341, 512)]),
    (SPLIT_MIN_OUTPUTS - 1, 2, [(0, 511)]),  # narrow: one block
    (1536, 1, [(0, 1536)]),
])
def test_column_blocks_cover_the_outputs_once(outputs, blocks, expected):
    assert column_blocks(outputs, blocks) == expected


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("blocks", [2, 3])
def test_a_model_in_column_blocks_gives_the_same_logits(tied, blocks):
    """gate/up (512 outputs), the embedding and the head (600) are cut in
    blocks; the lookup finds ids on both sides of every block's edge."""
    model = tiny_llama(tied, intermediate=SPLIT_MIN_OUTPUTS, vocab=600)
    tokens = mx.array([[0, 199, 200, 201, 299, 300, 301, 399, 400, 599]])
    before, looked_up = model(tokens), model.model.embed_tokens(tokens)
    transpose_linears(model, blocks)
    embed = model.model.embed_tokens
    assert len(embed["parts"]) == blocks and embed.weight.shape == (600, 64)
    assert len(model.model.layers[0].mlp.gate_proj["parts"]) == blocks
    assert len(model.model.layers[0].self_attn.k_proj["parts"]) == 1  # 32 outputs: one block
    assert mx.array_equal(embed(tokens), looked_up).item()
    assert mx.allclose(model(tokens), before, atol=1e-4).item()
    assert len(cpu_linear._streams) >= blocks - 1  # the other blocks ran on streams of their own


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 5, 600), (3, 1, 600), (4, 600)])  # a prompt, a batch of tokens, 2-D
def test_row_blocks_compute_the_same_product(bias, shape):
    mx.random.seed(9)
    linear = nn.Linear(600, 40, bias=bias)
    holder = nn.Module()
    holder.proj = linear
    transpose_linears(holder, 2)
    columns = holder.proj
    rows = columns.by_rows(2)
    assert rows.rows and len(rows["parts"]) == 2  # 600 inputs: 2 blocks
    x = mx.random.normal(shape)
    assert mx.allclose(rows(x), linear(x), atol=1e-4).item()
    assert rows.weight.shape == linear.weight.shape


def test_a_wide_layer_in_row_blocks_sums_the_blocks():
    """An MLP's down projection: 600 inputs (the gate's 2 column blocks) in 2 row blocks."""
    mx.random.seed(4)
    linear = nn.Linear(600, 600)
    holder = nn.Module()
    holder.proj = linear
    transpose_linears(holder, 2)
    rows = holder.proj.by_rows(2)
    assert [p.shape for p in rows["parts"]] == [(1, 300, 600), (1, 300, 600)]
    for shape in [(1, 3, 600), (1, 1, 600), (2, 1, 600)]:
        x = mx.random.normal(shape)
        assert mx.allclose(rows(x), linear(x), atol=1e-4).item()
    assert mx.array_equal(rows.weight, linear.weight).item()


@pytest.mark.parametrize("rows, streams", [(64, 2), (101, 2), (63, 2), (200, 1)])
def test_a_prompts_rows_on_two_streams_give_the_same_logits(rows, streams):
    """64 rows or more (a prompt) are cut over the streams; fewer (a token,
    a batch's decode step) stay on one."""
    model = tiny_llama(True, vocab=97)
    mx.random.seed(5)
    tokens = mx.random.randint(0, 97, (1, rows))
    before = model(tokens)
    transpose_linears(model, 1, streams)
    layers = [m for _, m in model.named_modules() if isinstance(m, (TransposedLinear, cpu_linear.StoredLinear))]
    assert layers and all(m.prompt_streams == streams for m in layers)
    assert mx.allclose(before, model(tokens), atol=1e-4).item()
    x = mx.random.normal((1, rows, 64))
    split = cpu_linear._by_prompt_rows(x, lambda v: v * 2, streams)
    assert split.shape == x.shape and mx.allclose(split, x * 2).item()
