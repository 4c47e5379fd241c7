"""GGUF files for tests, written the way llama.cpp's converter writes them.

`write_gguf(model_dir, out)` turns an MLX llama model folder (the demo
models) into a GGUF: llama.cpp's tensor names, q/k rows permuted for
interleaved RoPE (convert_hf_to_gguf.py's LlamaModel.permute), the
hyperparameters under `llama.*`, the byte-level BPE vocabulary, merges and
token types, and the chat template. Converting it back must give the same
model (tests/engine/test_gguf.py). `write_header_only` writes a header with
any tensor types, for refusals (MLX cannot write a Q6_K tensor).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# mlx-lm's names -> llama.cpp's (inverse of mlxd.gguf's map)
_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(mlx_name: str) -> str:
    stem, _, leaf = mlx_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{_PARTS[part]}.{leaf}"
    return f"{_TOP[stem]}.{leaf}"


def permute(w, n_head: int):
    """llama.cpp's q/k row order for interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qwen3_from_demo(demo_dir: Path, out: Path, seed: int = 7) -> Path:
    """A tiny random-weight qwen3 model (q/k norms, head_dim of its own, tied
    embeddings) with the demo model's tokenizer, as an MLX folder."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    demo = json.loads((demo_dir / "config.json").read_text())
    config = {"model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48, "rms_norm_eps": 1e-6,
              "vocab_size": demo["vocab_size"], "max_position_embeddings": 4096, "rope_theta": 1000000.0,
              "tie_word_embeddings": True}
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = {k: (mx.random.normal(v.shape) * 0.05).astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / name, out / name)
    return out


def write_gguf(model_dir: Path, out: Path) -> Path:
    """model_dir's model as llama.cpp writes a GGUF (llama or qwen3)."""
    import mlx.core as mx

    config = json.loads((model_dir / "config.json").read_text())
    architecture = config["model_type"]
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    weights = mx.load(str(model_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arrays = {}
    for name, w in weights.items():
        if architecture == "llama" and name.endswith("q_proj.weight"):  # only llama's are permuted
            w = permute(w, heads)
        elif architecture == "llama" and name.endswith("k_proj.weight"):
            w = permute(w, kv_heads)
        arrays[gguf_name(name)] = w
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    f32 = lambda v: mx.array(v, dtype=mx.float32)  # noqa: E731
    a = architecture
    metadata = {
        "general.architecture": a, "general.name": model_dir.name,
        f"{a}.block_count": u32(config["num_hidden_layers"]), f"{a}.embedding_length": u32(config["hidden_size"]),
        f"{a}.feed_forward_length": u32(config["intermediate_size"]),
        f"{a}.attention.head_count": u32(heads), f"{a}.attention.head_count_kv": u32(kv_heads),
        f"{a}.attention.layer_norm_rms_epsilon": f32(config["rms_norm_eps"]),
        f"{a}.rope.freq_base": f32(config["rope_theta"]), f"{a}.context_length": u32(config["max_position_embeddings"]),
        f"{a}.vocab_size": u32(config["vocab_size"]),
        **({f"{a}.attention.key_length": u32(config["head_dim"])} if "head_dim" in config else {}),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]],
        "tokenizer.ggml.token_type": mx.array([3 if t in special else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(vocab[tok_config["bos_token"]]),
        "tokenizer.ggml.eos_token_id": u32(vocab[tok_config["eos_token"]]),
        "tokenizer.ggml.padding_token_id": u32(vocab[tok_config["pad_token"]]),
        "tokenizer.ggml.add_bos_token": mx.array(tok.get("post_processor") is not None),
        "tokenizer.chat_template": tok_config["chat_template"],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    mx.save_gguf(str(out), arrays, metadata)
    return out


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_header_only(out: Path, architecture: str, tensor_types: dict[str, int],
                      tokenizer_model: str = "gpt2") -> Path:
    """A GGUF header (no tensor data) naming tensors of the given ggml type ids."""
    kvs = [("general.architecture", architecture), ("tokenizer.ggml.model", tokenizer_model)]
    body = struct.pack("<4sIQQ", b"GGUF", 3, len(tensor_types), len(kvs) + 1)
    for key, value in kvs:
        body += _string(key) + struct.pack("<I", 8) + _string(value)
    body += _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + _string("a") + _string("b")
    for name, type_id in tensor_types.items():
        body += _string(name) + struct.pack("<I", 2) + struct.pack("<QQ", 256, 4) + struct.pack("<IQ", type_id, 0)
    out.write_bytes(body)
    return out


def write_ollama_store(store: Path, name: str, gguf_path: Path) -> Path:
    """Lay `gguf_path` out in `store` as `ollama pull name` would: the blob
    under its sha256 digest and a manifest naming it as the model layer."""
    import hashlib

    from mlxd.ollama_store import MODEL_LAYER, manifest_parts

    data = gguf_path.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob = store / "blobs" / digest.replace(":", "-")
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    manifest = store.joinpath("manifests", *manifest_parts(name))
    manifest.parent.mkdir(parents=True, exist_ok=True)
    config_digest = "sha256:" + hashlib.sha256(b"{}").hexdigest()
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": config_digest,
                   "size": 2},
        "layers": [{"mediaType": MODEL_LAYER, "digest": digest, "size": len(data)},
                   {"mediaType": "application/vnd.ollama.image.template", "digest": config_digest, "size": 2}]}))
    return blob
