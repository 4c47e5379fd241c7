"""bench/cpu_arms.py: the CPU float32 path's layouts kept only to compare
(stored, split) against the engine's own (engine/cpu/). The split layout
computes what the model did -- column blocks on streams, row blocks summed,
a token's MLP a chain per stream -- and `install` puts a layout in place of
the engine's in this process."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxd.engine.cache.kv_cache import AllocatedKVCache
from mlxd.engine.cpu import cpu_decode, cpu_linear
from mlxd.engine.cpu.cpu_decode import FoldedLlamaAttention, FoldedQwen2Attention, RotationRoPE, shorten_decode
from mlxd.engine.cpu.cpu_linear import SharedColumns, StoredLinear, TransposedEmbedding, TransposedLinear
from testkit import load_bench
from tiny_models import decode, tiny, tiny_llama

arms = load_bench("cpu_arms")
SPLIT_MIN_OUTPUTS = arms.SPLIT_MIN_OUTPUTS





# --- which layout, how many blocks ------------------------------------------------------------

@pytest.mark.parametrize("layout, cores, expected", [
    ("split", 2, (True, 2, 1)),      # a block per core, up to MAX_BLOCKS (a prompt's rows on the blocks' streams)
    ("split", 16, (True, 2, 1)),
    ("split", 1, (True, 1, 1)),      # one core: no stream of its own for a second block
    ("transposed", 8, (True, 1, 2)),  # the engine's default, named
    ("transposed", 1, (True, 1, 1)),
    ("stored", 8, (False, 1, 1)),    # MLX's own layout
])
def test_the_layout_follows_its_name_and_the_cores(layout, cores, expected):
    assert arms.layout_plan(layout, cores) == expected


@pytest.mark.parametrize("layout", ["", "bogus", "Split"])
def test_an_unknown_layout_is_refused(layout):
    with pytest.raises(ValueError, match="unknown CPU layout"):
        arms.layout_plan(layout, 2)
    with pytest.raises(ValueError, match="unknown CPU layout"):
        arms.install(layout)


@pytest.mark.parametrize("outputs, blocks, expected", [
    (49152, 2, [(0, 24576), (24576, 49152)]),
    (577, 2, [(0, 288), (288, 577)]),
    (SPLIT_MIN_OUTPUTS, 3, [(0, 170), (170, 341), (341, 512)]),
    (SPLIT_MIN_OUTPUTS - 1, 2, [(0, 511)]),  # narrow: one block
    (1536, 1, [(0, 1536)]),
])
def test_column_blocks_cover_the_outputs_once(outputs, blocks, expected):
    assert arms.column_blocks(outputs, blocks) == expected


# --- the split layout ------------------------------------------------------------------------

@pytest.mark.parametrize("tied, layers", [(False, 2 * 7 + 2), (True, 2 * 7 + 1)])
def test_split_transposes_every_layer_and_gives_the_same_logits(tied, layers):
    """Every layer, the narrowing ones too (the MLP chains take the down
    projection in row blocks); at this width each in one block."""
    model = tiny_llama(tied)
    tokens = mx.array([[5, 17, 3, 88, 41, 2, 9]])
    before = model(tokens)
    assert arms.split_linears(model, 2) == layers
    kinds = {type(m) for _, m in model.named_modules()}
    assert not kinds & {nn.Linear, nn.Embedding, StoredLinear}
    assert TransposedLinear in kinds and TransposedEmbedding in kinds
    assert mx.allclose(before, model(tokens), atol=1e-4).item()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("blocks", [2, 3])
def test_a_model_in_column_blocks_gives_the_same_logits(tied, blocks):
    """gate/up (512 outputs), the embedding and the head (600) are cut in
    blocks; the lookup finds ids on both sides of every block's edge."""
    model = tiny_llama(tied, intermediate=SPLIT_MIN_OUTPUTS, vocab=600)
    tokens = mx.array([[0, 199, 200, 201, 299, 300, 301, 399, 400, 599]])
    before, looked_up = model(tokens), model.model.embed_tokens(tokens)
    arms.split_linears(model, blocks)
    embed = model.model.embed_tokens
    assert type(embed) is arms.BlockedEmbedding
    assert len(embed["parts"]) == blocks and embed.weight.shape == (600, 64)
    assert len(model.model.layers[0].mlp.gate_proj["parts"]) == blocks
    assert type(model.model.layers[0].self_attn.k_proj) is TransposedLinear  # 32 outputs: one block
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
    arms.split_linears(holder, 2)
    rows = arms.by_rows(holder.proj, 2)  # 40 outputs: the engine's TransposedLinear, cut by its 600 inputs
    assert rows.rows and len(rows["parts"]) == 2
    x = mx.random.normal(shape)
    assert mx.allclose(rows(x), linear(x), atol=1e-4).item()
    assert rows.weight.shape == linear.weight.shape


def test_a_wide_layer_in_row_blocks_sums_the_blocks():
    """An MLP's down projection: 600 inputs (the gate's 2 column blocks) in 2 row blocks."""
    mx.random.seed(4)
    linear = nn.Linear(600, 600)
    holder = nn.Module()
    holder.proj = linear
    arms.split_linears(holder, 2)
    assert type(holder.proj) is arms.ColumnBlocks and len(holder.proj["parts"]) == 2
    rows = arms.by_rows(holder.proj, 2)
    assert [p.shape for p in rows["parts"]] == [(1, 300, 600), (1, 300, 600)]
    for shape in [(1, 3, 600), (1, 1, 600), (2, 1, 600)]:
        x = mx.random.normal(shape)
        assert mx.allclose(rows(x), linear(x), atol=1e-4).item()
    assert mx.array_equal(rows.weight, linear.weight).item()


CACHES = {
    "mlx-lm's KVCache": lambda: KVCache(),
    "the engine's AllocatedKVCache": lambda: AllocatedKVCache(64),
    "a quantised cache (MLX's own ops)": lambda: QuantizedKVCache(group_size=32, bits=8),
}


@pytest.mark.parametrize("arch, folded, blocked", [("llama", FoldedLlamaAttention, arms.BlockedLlamaMLP),
                                                   ("qwen2", FoldedQwen2Attention, arms.BlockedQwen2MLP)])
@pytest.mark.parametrize("cache_kind", list(CACHES))
@pytest.mark.parametrize("blocks, intermediate", [(2, 256), (2, 512), (3, 600)])
def test_split_decoding_gives_the_same_logits_with_the_shortcuts(arch, folded, blocked, cache_kind, blocks,
                                                                 intermediate):
    """With an MLP of 512+ outputs, the MLP runs a chain per stream (its
    down projection in row blocks); narrower, as mlx-lm's. Through 8-bit KV
    a sum of row blocks, rounded unlike one product, can move a key across
    a quantisation step: those logits are compared to 1e-3, not 2e-4."""
    prompt = [5, 17, 3, 88, 41, 2, 9, 60, 33]
    reference = tiny(arch, intermediate=intermediate)
    expected = decode(reference, [CACHES[cache_kind]() for _ in reference.layers], prompt, 12)
    model = tiny(arch, intermediate=intermediate)
    arms.split_linears(model, blocks)
    mlp_blocked = intermediate >= SPLIT_MIN_OUTPUTS
    # per layer: attention, its RoPE, 2 norms; and the final norm -- then the MLPs
    assert shorten_decode(model) == 2 * 4 + 1
    assert arms.block_mlps(model) == 2 * mlp_blocked
    layer = model.model.layers[0]
    assert type(layer.self_attn) is folded and isinstance(layer.self_attn.rope, RotationRoPE)
    assert (type(layer.mlp) is blocked) == mlp_blocked
    assert getattr(layer.mlp.down_proj, "rows", False) == mlp_blocked  # in row blocks for the chains
    assert type(layer.mlp.down_proj) is not StoredLinear  # every layer transposed
    assert layer.mlp.down_proj.weight.shape == (128, intermediate)
    # the query, key and value projections (one block each at this width) are one product, their weights once
    assert type(layer.self_attn.q_proj) is SharedColumns and layer.self_attn.k_proj.weight.shape == (64, 128)
    names = [k for k, _ in tree_flatten(layer.self_attn.parameters())]
    assert not any(k.startswith(("q_proj", "k_proj", "v_proj")) for k in names), names
    got = decode(model, [CACHES[cache_kind]() for _ in model.layers], prompt, 12)
    atol = 1e-3 if cache_kind.startswith("a quantised") else 2e-4
    for step, (a, b) in enumerate(zip(got, expected)):
        assert mx.allclose(a, b, atol=atol).item(), f"step {step}: max diff {mx.abs(a - b).max().item()}"


def test_wide_attention_projections_in_blocks_are_not_shared():
    """q in column blocks (512 outputs): the attention keeps its three
    products (one product would join the blocks' streams first)."""
    args = llama.ModelArgs(model_type="llama", hidden_size=512, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50)
    mx.random.seed(2)
    model = llama.Model(args)
    mx.eval(model.parameters())
    arms.split_linears(model, 2)
    shorten_decode(model)
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj) is arms.ColumnBlocks and "qkv_proj" not in attn


# --- applying a layout -----------------------------------------------------------------------

def kinds(model: nn.Module) -> list[str]:
    return [type(m).__name__ for _, m in model.named_modules()]


def test_stored_keeps_mlx_lms_model_as_it_is():
    model = tiny("llama")
    before = kinds(model)
    assert arms.apply_layout(model, "stored", cores=2) == "as stored"
    assert kinds(model) == before and "Linear" in before


def test_transposed_is_the_engines_own_layout(monkeypatch):
    monkeypatch.setattr(cpu_decode, "usable_cores", lambda: 2)
    mine, engines = tiny("qwen2"), tiny("qwen2")
    assert arms.apply_layout(mine, "transposed") == cpu_decode.prepare_float32(engines)
    assert kinds(mine) == kinds(engines) and "StoredLinear" in kinds(mine)


@pytest.mark.parametrize("cores, log, blocked", [
    (2, "transposed, wide layers in 2 column blocks on parallel CPU streams", True),
    (1, "transposed, a prompt's rows on 1 CPU stream(s)", False),  # one core: the default's layout, one stream
])
def test_split_on_the_cores_there_are(cores, log, blocked):
    prompt = [5, 17, 3, 88, 41, 2, 9]
    reference = tiny("llama", intermediate=SPLIT_MIN_OUTPUTS)
    expected = decode(reference, [KVCache() for _ in reference.layers], prompt, 4)
    model = tiny("llama", intermediate=SPLIT_MIN_OUTPUTS)
    assert arms.apply_layout(model, "split", cores=cores) == log
    assert (type(model.model.layers[0].mlp) is arms.BlockedLlamaMLP) == blocked
    got = decode(model, [KVCache() for _ in model.layers], prompt, 4)
    for a, b in zip(got, expected):
        assert mx.allclose(a, b, atol=2e-4).item()


def test_install_puts_the_layout_in_place_of_the_engines(monkeypatch):
    monkeypatch.setattr(cpu_decode, "prepare_float32", cpu_decode.prepare_float32)  # restored after the test
    engines = cpu_decode.prepare_float32
    arms.install("stored")
    assert cpu_decode.prepare_float32 is not engines
    model = tiny("llama")
    assert cpu_decode.prepare_float32(model) == "as stored"  # what engine/model/model_load.py calls
    assert "Linear" in kinds(model) and "TransposedLinear" not in kinds(model)
