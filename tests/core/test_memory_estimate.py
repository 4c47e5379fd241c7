"""Heavy-model estimate on fabricated configs and headers (pure functions)."""

import json
import struct

import pytest

from mlxd import memory_estimate as me
from mlxd import moe_expert_bytes as moe

GIB = 1024**3
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}
LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("config, params_b", [(LLAMA_8B, 8.03), (LLAMA_70B, 70.6)])
def test_params_from_config_match_published_sizes(config, params_b):
    assert me.params_from_config(config) / 1e9 == pytest.approx(params_b, rel=0.03)


@pytest.mark.parametrize("config, expected", [
    (LLAMA_8B, 2.0),
    ({**LLAMA_8B, "quantization": {"bits": 4, "group_size": 64}}, 0.5 + 4 / 64),
    ({**LLAMA_8B, "torch_dtype": "float32"}, 4.0),
])
def test_bytes_per_param(config, expected):
    assert me.bytes_per_param(config) == pytest.approx(expected)


def test_kv_cache_bytes_llama_8b_8k_context():
    # 2 (K,V) x 32 layers x 8 kv heads x 128 dims x 8192 tokens x 2 bytes = 1 GiB
    assert me.kv_cache_bytes(LLAMA_8B, 8192) == GIB


SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "torch_dtype": "bfloat16"}  # head_dim 64


@pytest.mark.parametrize("head_dim, configured, expected", [
    (128, 64, 64), (128, 128, 128), (64, 128, 64), (96, 128, 32), (96, 64, 32), (80, 64, None),
    (256, 32, 32), (48, 64, None),
])
def test_kv_group_fits_the_head(head_dim, configured, expected):
    assert me.kv_group(head_dim, configured) == expected


@pytest.mark.parametrize("config, settings, expected", [
    (LLAMA_8B, (16, 64, 0), me.KVLayout()),
    (LLAMA_8B, (8, 64, 0), me.KVLayout(8, 64, 0)),
    (LLAMA_8B, (4, 128, 512), me.KVLayout(4, 128, 512)),
    (SMOLLM2, (8, 128, 0), me.KVLayout(8, 64, 0)),  # its heads are 64 wide
    ({**LLAMA_8B, "head_dim": 80}, (8, 64, 0), me.KVLayout()),  # no group divides 80 but 16: stays 16 bits
    (None, (8, 64, 0), me.KVLayout()),  # shape unknown
])
def test_kv_layout_for(config, settings, expected):
    assert me.kv_layout_for(config, *settings) == expected


@pytest.mark.parametrize("layout, per_value", [
    (me.KVLayout(), 2.0),
    (me.KVLayout(8, 64), 1 + 4 / 64),  # a byte, and a bfloat16 scale and bias per 64 values
    (me.KVLayout(8, 128), 1 + 4 / 128),
    (me.KVLayout(4, 64), 0.5 + 4 / 64),
    (me.KVLayout(4, 32), 0.5 + 4 / 32),
])
def test_kv_value_bytes(layout, per_value):
    assert me.kv_value_bytes(2, layout) == per_value
    assert me.kv_cache_bytes(LLAMA_8B, 8192, layout=layout) == int(GIB / 2 * per_value)


@pytest.mark.parametrize("layout, contexts", [
    (me.KVLayout(8, 128), 1.93),  # the goal: >= 1.9x the context in the same memory
    (me.KVLayout(8, 64), 1.88),
    (me.KVLayout(4, 64), 3.55),
])
def test_quantised_kv_holds_more_context_in_the_same_memory(layout, contexts):
    budget = me.kv_cache_bytes(LLAMA_8B, 32768)
    fits = max(n for n in range(32768, 4 * 32768, 256) if me.kv_cache_bytes(LLAMA_8B, n, layout=layout) <= budget)
    assert fits / 32768 == pytest.approx(contexts, abs=0.01)


def test_kv_quantised_from_a_start_counts_both_copies_at_the_switch():
    layout = me.KVLayout(8, 64, 1024)
    full, quantised = me.kv_cache_bytes(LLAMA_8B, 1024), me.kv_cache_bytes(LLAMA_8B, 4096, layout=me.KVLayout(8, 64))
    assert me.kv_cache_bytes(LLAMA_8B, 1000, layout=layout) == me.kv_cache_bytes(LLAMA_8B, 1000)
    assert me.kv_cache_bytes(LLAMA_8B, 4096, layout=layout) == quantised + full


@pytest.mark.parametrize("tokens, allocated", [(1, 256), (256, 256), (257, 512), (4200, 4352)])
def test_kv_allocated_in_whole_steps(tokens, allocated):
    assert me.kv_allocated_tokens(tokens) == allocated


@pytest.mark.parametrize("tokens, allocated", [
    (1, 256), (256, 256), (257, 512), (2048, 2048), (2049, 2304),  # below 4k: whole steps of 256
    (4200, 4608),                                                  # 4k-8k: steps of 512
    (15000, 15360), (16384, 16384), (16385, 18432),                # 8k-16k: 1,024; 16k-32k: 2,048
    (100_000, 106_496),                                            # 64k-128k: 8,192
])
def test_kv_allocated_in_coarse_steps(tokens, allocated):
    assert me.kv_allocated_tokens(tokens, coarse=True) == allocated
    assert allocated - tokens < max(256, tokens / 8)  # never an eighth more than it needs, beyond a step


def test_coarse_steps_meet_few_lengths():
    """Every length from 8k to 128k tokens allocates one of 8 lengths an octave (cuDNN: a graph each)."""
    lengths = {me.kv_allocated_tokens(n, coarse=True) for n in range(8193, 131_073, 7)}
    assert len(lengths) == 4 * 8


def test_a_quantised_prefill_counts_two_dequantised_layers():
    layout = me.KVLayout(8, 64)
    assert me.kv_prefill_transient_bytes(LLAMA_8B, 8192, me.KVLayout()) == 0
    assert me.kv_prefill_transient_bytes(LLAMA_8B, 8192, layout) == 2 * GIB // 32


def test_kv_cache_respects_sliding_window():
    cfg = {**LLAMA_8B, "use_sliding_window": True, "sliding_window": 4096}
    assert me.kv_cache_bytes(cfg, 32768) == me.kv_cache_bytes(LLAMA_8B, 4096)


@pytest.mark.parametrize("name, approx_gb", [
    ("mlx-community/Llama-3.3-70B-Instruct-4bit", 70 * (0.5 + 4 / 64)),
    ("Qwen2.5-7B-Instruct", 7 * 2),
    ("mlx-community/Mixtral-8x7B-Instruct-v0.1-4bit", 56 * (0.5 + 4 / 64)),
    ("Qwen3-30B-A3B-8bit", 30 * (1 + 4 / 64)),
    ("mistral-small-3.1-24b-instruct-2503-bf16", 24 * 2),
])
def test_weights_from_name(name, approx_gb):
    assert me.weights_from_name(name) / 1e9 == pytest.approx(approx_gb, rel=0.01)


@pytest.mark.parametrize("name", ["my-model", "phi-mini", "gpt2"])
def test_weights_from_name_unknown(name):
    assert me.weights_from_name(name) is None


def test_safetensors_headers_are_summed(tmp_path):
    header = {"__metadata__": {"format": "mlx"}, "w": {"dtype": "F16", "shape": [10, 10], "data_offsets": [0, 200]},
              "b": {"dtype": "F32", "shape": [10], "data_offsets": [200, 240]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 240)
    assert me.read_weight_bytes(tmp_path) == (240, "safetensors headers")


def test_index_total_size_wins(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 12345}}))
    assert me.read_weight_bytes(tmp_path) == (12345, "safetensors index")


def test_corrupt_header_is_unknown_not_a_crash(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 4)
    assert me.read_weight_bytes(tmp_path) is None


BUDGET = 24 * GIB


@pytest.mark.parametrize("name, footprint, allowed, words", [
    ("llama-8b", me.Footprint(16 * GIB, GIB, "config shape"), True, "needs about"),
    ("llama-70b", me.Footprint(140 * GIB, 2 * GIB, "config shape"), False, "over the memory budget of 24.0 GiB"),
    ("Qwen2.5-72B-Instruct", me.Footprint(None, 0, "unknown"), False, "heavy pattern '72b'"),
    ("command-r-plus-104b", me.Footprint(None, 0, "unknown"), False, "heavy pattern '104b'"),
    ("my-model", me.Footprint(None, 0, "unknown"), True, "unknown"),
    ("tiny-1.72b", me.Footprint(None, 0, "unknown"), True, "unknown"),   # '72b' inside 1.72b is not a match
])
def test_judge(name, footprint, allowed, words):
    verdict = me.judge(name, footprint, BUDGET, ["70b", "72b", "104b"])
    assert verdict.allowed is allowed and words in verdict.reason


def test_estimate_prefers_files_then_config_then_name():
    assert me.estimate_footprint(LLAMA_8B, (5, "safetensors headers"), "x", 8192).source == "safetensors headers"
    assert me.estimate_footprint(LLAMA_8B, None, "x", 8192).source == "config shape"
    assert me.estimate_footprint(None, None, "Llama-70B", 8192).source == "model name"
    fp = me.estimate_footprint(None, None, "mystery", 8192)
    assert fp.source == "unknown" and fp.total_bytes is None


@pytest.mark.parametrize("configured, memory_tier, free, expected", [
    (None, 2 * GIB, 500 * GIB, 8 * GIB),         # a small memory tier: the 8 GiB floor
    (None, 30 * GIB, 500 * GIB, 30 * GIB),       # as much as memory holds: a crash finds it all on disk
    (None, 30 * GIB, 40 * GIB, 10 * GIB),        # never more than a quarter of the free disk
    (None, 2 * GIB, 20 * GIB, 5 * GIB),          # the quarter wins over the floor too
    (3 * GIB, 30 * GIB, 1 * GIB, 3 * GIB),       # configured: as configured
    (0, 30 * GIB, 500 * GIB, 0),
])
def test_the_disk_tier_holds_what_the_memory_tier_may_hold(configured, memory_tier, free, expected):
    assert me.disk_tier_budget(configured, memory_tier, free) == expected


@pytest.mark.parametrize("model, draft, weights, source_says", [
    (me.Footprint(100, 10, "safetensors headers"), me.Footprint(20, 5, "safetensors headers"), 125, "with draft d"),
    (me.Footprint(100, 10, "config shape"), me.Footprint(None, 5, "unknown"), 100, "draft d not counted"),
    (me.Footprint(None, 10, "unknown"), me.Footprint(20, 5, "config shape"), None, "unknown"),
])
def test_a_draft_models_weights_and_kv_count_as_its_models_weights(model, draft, weights, source_says):
    from mlxd.models import with_draft

    fp = with_draft(model, draft, "d")
    assert fp.weights_bytes == weights and fp.kv_bytes == model.kv_bytes and source_says in fp.source


# --- routed experts cast to float32 on the CPU (gather_mm runs float32 only) ---
# Names as the checkpoints on the hub and mlx-lm's sanitize (mlx_lm/models/<type>.py) spell them.

@pytest.mark.parametrize("name, routed", [
    # qwen3_moe, olmoe, qwen3_next: HF per expert, mlx-lm stacked
    ("model.layers.3.mlp.experts.17.gate_proj.weight", True),
    ("model.layers.3.mlp.switch_mlp.down_proj.weight", True),
    ("model.layers.3.mlp.gate.weight", False),  # the router
    ("model.layers.3.mlp.shared_expert.up_proj.weight", False),  # qwen3_next's shared expert
    ("model.layers.3.mlp.shared_expert_gate.weight", False),
    ("mtp.layers.0.mlp.experts.0.up_proj.weight", False),  # qwen3_next's MTP head: dropped at load
    # mixtral
    ("model.layers.0.block_sparse_moe.experts.7.w1.weight", True),
    ("model.layers.0.block_sparse_moe.switch_mlp.up_proj.weight", True),
    ("model.layers.0.block_sparse_moe.gate.weight", False),
    # deepseek_v3, glm4_moe
    ("model.layers.5.mlp.experts.255.down_proj.weight", True),
    ("model.layers.5.mlp.shared_experts.gate_proj.weight", False),
    ("model.layers.5.mlp.gate.e_score_correction_bias", False),
    # gpt_oss: HF stacked (bias included: SwitchLinear casts it too), mlx-lm's experts.*_proj
    ("model.layers.0.mlp.experts.gate_up_proj", True),
    ("model.layers.0.mlp.experts.gate_up_proj_bias", True),
    ("model.layers.0.mlp.experts.down_proj", True),
    ("model.layers.0.mlp.experts.gate_proj.bias", True),
    ("model.layers.0.mlp.router.weight", False),
    # granitemoe(hybrid): HF stacked input/output_linear; its shared_mlp is dense
    ("model.layers.2.block_sparse_moe.input_linear.weight", True),
    ("model.layers.2.block_sparse_moe.output_linear.weight", True),
    ("model.layers.2.block_sparse_moe.router.layer.weight", False),
    ("model.layers.2.shared_mlp.input_linear.weight", False),
    # llama4
    ("language_model.model.layers.1.feed_forward.experts.gate_up_proj", True),
    ("language_model.model.layers.1.feed_forward.experts.gate_proj.weight", True),
    ("language_model.model.layers.1.feed_forward.shared_expert.down_proj.weight", False),
    ("language_model.model.layers.1.feed_forward.router.weight", False),
    # nemotron_h
    ("backbone.layers.2.mixer.experts.3.up_proj.weight", True),
    ("backbone.layers.2.mixer.switch_mlp.fc1.weight", True),
    ("backbone.layers.2.mixer.shared_experts.up_proj.weight", False),
    # qwen3_5_moe / qwen3_vl_moe (HF stacked), gemma4 (switch_glu), step3p5 (moe.*_proj)
    ("model.language_model.layers.0.mlp.experts.gate_up_proj", True),
    ("model.layers.0.experts.switch_glu.gate_proj.weight", True),
    ("model.layers.0.router.per_expert_scale", False),
    ("model.layers.4.moe.gate_proj.weight", True),
    ("model.layers.4.moe.gate.weight", False),
    ("transformer.h.0.moe.mlp.3.fc1.weight", True),  # phixtral
    # dbrx: its experts are dense MLPs (no gather_mm)
    ("transformer.blocks.0.ffn.experts.mlp.w1", False),
    # dense models
    ("model.layers.0.mlp.gate_proj.weight", False),
    ("model.embed_tokens.weight", False),
])
def test_which_tensors_are_routed_experts(name, routed):
    assert moe.is_routed_expert_tensor(name) is routed


def _tensors(*specs: tuple[str, str, int]) -> dict:
    """A safetensors header from (name, dtype, bytes)."""
    header, offset = {"__metadata__": {"format": "mlx"}}, 0
    for name, dtype, size in specs:
        header[name] = {"dtype": dtype, "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    return header


E = "model.layers.0.mlp.switch_mlp"


@pytest.mark.parametrize("header, expected", [
    (_tensors((f"{E}.gate_proj.weight", "BF16", 1000), (f"{E}.up_proj.weight", "BF16", 1000),
              (f"{E}.down_proj.weight", "BF16", 1000), ("model.layers.0.mlp.gate.weight", "BF16", 10),
              ("model.embed_tokens.weight", "BF16", 500)), 3000),
    (_tensors((f"{E}.gate_proj.weight", "F16", 1000)), 1000),  # float16 too
    (_tensors((f"{E}.gate_proj.weight", "F32", 2000)), 0),  # float32 already: no growth
    # mlx-lm quantised: uint32 weight, scales and biases beside it (gather_qmm runs them as they are)
    (_tensors((f"{E}.gate_proj.weight", "U32", 500), (f"{E}.gate_proj.scales", "BF16", 60),
              (f"{E}.gate_proj.biases", "BF16", 60)), 0),
    # a quantised expert's linear bias stays too (gpt-oss 4-bit)
    (_tensors(("m.mlp.experts.gate_proj.weight", "U32", 500), ("m.mlp.experts.gate_proj.scales", "BF16", 60),
              ("m.mlp.experts.gate_proj.biases", "BF16", 60), ("m.mlp.experts.gate_proj.bias", "BF16", 8)), 0),
    # gpt-oss bf16 from the hub: stacked, with its biases
    (_tensors(("m.mlp.experts.gate_up_proj", "BF16", 2000), ("m.mlp.experts.gate_up_proj_bias", "BF16", 20),
              ("m.mlp.experts.down_proj", "BF16", 1000), ("m.mlp.experts.down_proj_bias", "BF16", 10)), 3030),
    # gpt-oss mxfp4 from the hub: blocks and scales (U8); only the bias is bf16, and it stays with them
    (_tensors(("m.mlp.experts.gate_up_proj_blocks", "U8", 900), ("m.mlp.experts.gate_up_proj_scales", "U8", 50),
              ("m.mlp.experts.gate_up_proj_bias", "BF16", 20)), 0),
    # deepseek-v3 fp8 from the hub: not a 16-bit expert
    (_tensors(("model.layers.3.mlp.experts.0.up_proj.weight", "F8_E4M3", 1000),
              ("model.layers.3.mlp.experts.0.up_proj.weight_scale_inv", "F32", 16)), 0),
    # GPTQ/AWQ-style per expert: qweight, its fp16 scales
    (_tensors(("model.layers.3.mlp.experts.0.up_proj.qweight", "I32", 1000),
              ("model.layers.3.mlp.experts.0.up_proj.scales", "F16", 64)), 0),
    # shared experts and a dense model: nothing
    (_tensors(("model.layers.1.mlp.shared_experts.up_proj.weight", "BF16", 1000)), 0),
    (_tensors(("model.layers.0.mlp.gate_proj.weight", "BF16", 1000)), 0),
])
def test_float16_expert_bytes(header, expected):
    assert moe.float16_expert_bytes(header) == expected


def test_expert_bytes_are_read_from_every_shard_as_one_header(tmp_path):
    def write(name: str, header: dict) -> None:
        raw = json.dumps(header).encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(raw)) + raw)

    # a quantised expert whose scales landed in the next shard is still quantised
    write("model-00001-of-00002.safetensors", _tensors((f"{E}.up_proj.weight", "BF16", 1000),
                                                       (f"{E}.gate_proj.weight", "U32", 500)))
    write("model-00002-of-00002.safetensors", _tensors((f"{E}.gate_proj.scales", "BF16", 60),
                                                       ("model.layers.1.mlp.switch_mlp.up_proj.weight", "BF16", 700)))
    assert moe.read_float16_expert_bytes(tmp_path) == 1700
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 4)
    assert moe.read_float16_expert_bytes(tmp_path) is None  # unreadable: unknown, not a crash
    assert moe.read_float16_expert_bytes(tmp_path / "missing") is None


@pytest.mark.parametrize("footprint, experts, weights, source", [
    (me.Footprint(4000, 100, "safetensors headers"), 3000, 7000, "safetensors headers + experts as float32 on the CPU"),
    (me.Footprint(4000, 100, "safetensors headers"), 0, 4000, "safetensors headers"),  # not an MoE
    (me.Footprint(4000, 100, "safetensors index"), None, 4000, "safetensors index"),  # headers unreadable
    (me.Footprint(None, 100, "unknown"), 3000, None, "unknown"),
])
def test_float32_experts_grow_the_weights_by_their_stored_bytes(footprint, experts, weights, source):
    fp = moe.with_float32_experts(footprint, experts)
    assert (fp.weights_bytes, fp.kv_bytes, fp.source) == (weights, footprint.kv_bytes, source)
