"""GGUF files without MLX: the header (metadata and tensor table), what MLX
can load of it, and the mlx-lm model config it maps to (pure, stdlib only).

GGUF (llama.cpp's format): magic "GGUF", a version, the tensor and metadata
counts, the metadata key/values (typed), then one entry per tensor (name,
dims, ggml type, offset). The engine converts a supported file into an MLX
model folder (engine/model/gguf_convert.py); the heavy-model estimate and the
gateway read the header only, here.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
HASHED_HEADER_BYTES = 1 << 20  # the cache key hashes this much of the file's start

# ggml tensor types: id -> (name, elements per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
}
# What MLX loads as it is (quantized ones as MLX affine weights, group size 32),
# with the bytes per element it then holds (scales and biases in float16).
MLX_BYTES_PER_ELEMENT = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q4_0": 20 / 32, "Q4_1": 20 / 32, "Q8_0": 36 / 32}
ARCHITECTURES = ("llama", "qwen2", "qwen3")

# metadata value types: id -> struct format (None: string, array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF we can read or serve; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml's order: fastest-varying dimension first
    type_name: str

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def file_bytes(self) -> int | None:
        for name, per_block, block_bytes in GGML_TYPES.values():
            if name == self.type_name:
                return self.elements // per_block * block_bytes
        return None


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def meta(self, key: str, default: Any = None) -> Any:
        """An architecture's own key, e.g. meta("block_count") -> llama.block_count."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors)


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise GGUFError("the file ends inside its header (truncated?)")
    return struct.unpack(fmt, raw)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > 1 << 24:
        raise GGUFError(f"a header string of {n} bytes: not a GGUF header")
    raw = f.read(n)
    if len(raw) != n:
        raise GGUFError("the file ends inside its header (truncated?)")
    return raw.decode("utf-8", errors="replace")


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        item_type, count = _read(f, "<I"), _read(f, "<Q")
        if count > 1 << 26:
            raise GGUFError(f"a header array of {count} items: not a GGUF header")
        return [_value(f, item_type) for _ in range(count)]
    raise GGUFError(f"unknown metadata value type {vtype}")


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file (no tensor data is read)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise GGUFError(f"{path} is not a GGUF file (no GGUF magic)")
            version = _read(f, "<I")
            if version not in (2, 3):
                raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            metadata = {}
            for _ in range(n_kv):
                key = _string(f)
                metadata[key] = _value(f, _read(f, "<I"))
            tensors = []
            for _ in range(n_tensors):
                name = _string(f)
                dims = tuple(_read(f, "<Q") for _ in range(_read(f, "<I")))
                type_id = _read(f, "<I")
                _read(f, "<Q")  # offset into the data section
                tensors.append(TensorInfo(name, dims, GGML_TYPES.get(type_id, (f"type {type_id}", 0, 0))[0]))
    except OSError as exc:
        raise GGUFError(f"cannot read {path}: {exc.strerror}") from None
    return GGUFHeader(version, metadata, tuple(tensors))


def unsupported(header: GGUFHeader) -> str | None:
    """Why MLX cannot serve this file as it is, or None (pure)."""
    if header.architecture not in ARCHITECTURES:
        return (f"GGUF architecture {header.architecture!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})")
    odd = sorted({t.type_name for t in header.tensors} - set(MLX_BYTES_PER_ELEMENT))
    if odd:
        return (f"GGUF tensor type {', '.join(odd)} is not supported (MLX loads "
                f"{', '.join(MLX_BYTES_PER_ELEMENT)} as they are); use a Q4_0, Q4_1 or Q8_0 file of this model")
    tokenizer = header.metadata.get("tokenizer.ggml.model")
    if tokenizer != "gpt2" or not header.metadata.get("tokenizer.ggml.tokens"):
        return (f"GGUF tokenizer {tokenizer!r} is not supported (mlxd builds byte-level BPE tokenizers, "
                f"GGUF's 'gpt2', from the file)")
    if "rope_freqs.weight" in header.tensor_names:
        return "this GGUF carries Llama 3.1-style RoPE frequency factors (rope_freqs), which mlxd cannot map yet"
    return None


def weight_bytes(header: GGUFHeader) -> int:
    """What the weights take once loaded by MLX (quantized ones stay so)."""
    return int(sum(t.elements * MLX_BYTES_PER_ELEMENT.get(t.type_name, 2.0) for t in header.tensors))


def mlx_config(header: GGUFHeader) -> dict[str, Any]:
    """The config.json mlx-lm needs for this file's model (pure). Quantization
    is added by the converter, which sees the loaded arrays."""
    h, arch = header, header.architecture
    heads = int(h.meta("attention.head_count"))
    hidden = int(h.meta("embedding_length"))
    tokens = h.metadata.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(h.meta("block_count")),
        "intermediate_size": int(h.meta("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(h.meta("attention.head_count_kv", heads)),
        "rms_norm_eps": float(h.meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(h.meta("vocab_size", len(tokens))),
        "rope_theta": float(h.meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(h.meta("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in h.tensor_names,
        # llama.cpp stores a llama's q/k rows permuted for interleaved RoPE:
        # with rope_traditional MLX applies exactly that (qwen's are not permuted).
        "rope_traditional": arch == "llama",
    }
    head_dim = h.meta("attention.key_length")
    if head_dim is not None and int(head_dim) != hidden // heads or arch == "qwen3":
        config["head_dim"] = int(head_dim if head_dim is not None else hidden // heads)
    return config


# llama.cpp's tensor names -> mlx-lm's (per layer "blk.N.<part>").
LAYER_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def mlx_tensor_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.scales' -> 'model.layers.3.self_attn.q_proj.scales';
    None for a tensor mlx-lm has no place for (pure)."""
    stem, _, leaf = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        mapped = LAYER_PARTS.get(part)
        return f"model.layers.{layer}.{mapped}.{leaf}" if mapped else None
    mapped = TOP_LEVEL.get(stem)
    return f"{mapped}.{leaf}" if mapped else None


def cache_key(path: Path) -> str:
    """Names one version of a file: its size, mtime and the hash of its
    start (where the header, and so any re-quantization, shows)."""
    st = os.stat(path)
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(HASHED_HEADER_BYTES))
    return h.hexdigest()[:24]
