"""GGUF headers without MLX: reading, what is refused and why, the tensor
names and model config mlx-lm gets, the heavy-model estimate, and the cache key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxd import gguf
from mlxd.config import parse_config
from mlxd.devkit.gguf_fixture import write_gguf, write_header_only
from mlxd.models import model_info

Q4_1, Q6_K, F16 = 3, 14, 1


@pytest.fixture(scope="module")
def demo_gguf(demo_models, tmp_path_factory) -> Path:
    return write_gguf(demo_models.a, tmp_path_factory.mktemp("gguf") / "demo-a.gguf")


def test_the_header_of_a_written_gguf_reads_back(demo_gguf, demo_models):
    import json

    h = gguf.read_header(demo_gguf)
    config = json.loads((demo_models.a / "config.json").read_text())
    assert h.architecture == "llama" and h.meta("block_count") == config["num_hidden_layers"]
    assert len(h.metadata["tokenizer.ggml.tokens"]) == config["vocab_size"]
    assert "blk.0.attn_q.weight" in h.tensor_names and {t.type_name for t in h.tensors} == {"F32"}
    assert gguf.unsupported(h) is None


def test_mlx_config_from_the_header_matches_the_original(demo_gguf, demo_models):
    import json

    original = json.loads((demo_models.a / "config.json").read_text())
    mapped = gguf.mlx_config(gguf.read_header(demo_gguf))
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert mapped[key] == original[key], key
    assert mapped["rope_traditional"] is True  # llama.cpp permuted q/k for interleaved RoPE
    assert mapped["rms_norm_eps"] == pytest.approx(original["rms_norm_eps"])


@pytest.mark.parametrize("architecture, types, tokenizer, refusal", [
    ("llama", {"blk.0.attn_q.weight": Q4_1}, "gpt2", None),
    ("qwen3", {"blk.0.attn_q.weight": F16}, "gpt2", None),
    ("gemma2", {"blk.0.attn_q.weight": F16}, "gpt2", "architecture 'gemma2' is not supported"),
    ("llama", {"blk.0.attn_q.weight": Q6_K, "blk.0.attn_k.weight": Q4_1}, "gpt2", "tensor type Q6_K"),
    ("llama", {"blk.0.attn_q.weight": F16}, "llama", "tokenizer 'llama' is not supported"),
    ("llama", {"rope_freqs.weight": F16}, "gpt2", "rope_freqs"),
])
def test_what_mlx_cannot_serve_is_refused_naming_why(tmp_path, architecture, types, tokenizer, refusal):
    h = gguf.read_header(write_header_only(tmp_path / "m.gguf", architecture, types, tokenizer))
    problem = gguf.unsupported(h)
    assert (problem is None) if refusal is None else (refusal in problem)


@pytest.mark.parametrize("content, says", [
    (b"not a gguf at all", "no GGUF magic"),
    (b"GGUF\x03\x00\x00\x00\x01", "truncated"),
    (b"GGUF\x09\x00\x00\x00" + b"\x00" * 16, "version 9"),
])
def test_a_file_that_is_not_a_gguf_is_a_clear_error(tmp_path, content, says):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(gguf.GGUFError, match=says):
        gguf.read_header(path)


@pytest.mark.parametrize("gguf_name, mlx_name", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("token_embd.scales", "model.embed_tokens.scales"),
    ("blk.12.attn_q.biases", "model.layers.12.self_attn.q_proj.biases"),
    ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
    ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
    ("blk.3.attn_q_norm.weight", "model.layers.3.self_attn.q_norm.weight"),
    ("blk.1.attn_q.bias", "model.layers.1.self_attn.q_proj.bias"),
    ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("rope_freqs.weight", None),
    ("blk.0.some_new_thing.weight", None),
])
def test_tensor_names_map_to_mlx_lm(gguf_name, mlx_name):
    assert gguf.mlx_tensor_name(gguf_name) == mlx_name


@pytest.mark.parametrize("type_id, type_name, file_bytes", [(0, "F32", 4096), (3, "Q4_1", 640), (8, "Q8_0", 1088),
                                                            (14, "Q6_K", 840)])
def test_tensor_sizes_follow_ggml_blocks(tmp_path, type_id, type_name, file_bytes):
    h = gguf.read_header(write_header_only(tmp_path / "m.gguf", "llama", {"t.weight": type_id}))
    (t,) = h.tensors
    assert (t.type_name, t.elements, t.file_bytes) == (type_name, 1024, file_bytes)


def test_the_heavy_model_estimate_reads_the_gguf_header(demo_gguf, tmp_path):
    config = parse_config({"models": {"g": {"gguf": str(demo_gguf)}}, "embeddings": {}}, tmp_path)  # no encoder beside
    info = model_info(config, "g", budget_bytes=10 * 2**30)
    assert info.footprint.source == "GGUF header" and info.on_disk
    assert info.footprint.weights_bytes == gguf.weight_bytes(gguf.read_header(demo_gguf))
    assert info.footprint.weights_bytes == pytest.approx(demo_gguf.stat().st_size, rel=0.1)  # F32 as it is
    assert not model_info(config, "g", budget_bytes=2**20).verdict.allowed  # over a 1 MiB budget


def test_the_cache_key_changes_with_the_file(demo_gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(demo_gguf.read_bytes())
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))
    key = gguf.cache_key(copy)
    assert gguf.cache_key(copy) == key
    os.utime(copy, ns=(2_000_000_000, 2_000_000_000))  # touched: converted again
    assert gguf.cache_key(copy) != key


def test_gguf_is_one_of_the_exclusive_model_sources(tmp_path):
    from mlxd.config import ConfigError

    with pytest.raises(ConfigError, match="exactly one of path, repo, gguf, from_ollama, demo"):
        parse_config({"models": {"g": {"gguf": "/x.gguf", "path": "/y"}}}, tmp_path)
