"""Heavy-model exclusion: estimate a model's memory before loading it and
refuse it when it does not fit the budget.

Memory pressure is what makes Metal abort the engine, so a model that cannot
fit is refused with a clear error instead of being loaded to crash later.
Estimate = weights + KV cache for the allowed context. Weights come, in order
of trust, from the safetensors index's total_size, the safetensors headers,
the config's shape (parameter count x bytes per parameter), or the model's
name ("...-70B-...-4bit"). On MLX's CPU backend a MoE's 16-bit experts
count at float32, as its load casts them (mlxd.moe_expert_bytes). The
functions here are pure except the `read_*` ones, which read file headers only.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3

TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class Footprint:
    weights_bytes: int | None  # None: unknown
    kv_bytes: int
    source: str  # how weights_bytes was found

    @property
    def total_bytes(self) -> int | None:
        return None if self.weights_bytes is None else self.weights_bytes + self.kv_bytes


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str  # a sentence for the error message and the logs


# --- weights -------------------------------------------------------------

def safetensors_header_bytes(header: dict[str, Any]) -> int:
    """Tensor bytes described by one safetensors header (pure)."""
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        total += end - start
    return total


SAFETENSORS_HEADER_LIMIT = 100 * 1024**2  # a larger header is not a safetensors file we trust


def read_safetensors_headers(model_dir: Path) -> list[dict[str, Any]] | None:
    """The header of every *.safetensors file in a folder (the files' first
    bytes only); None when there is none, or one is unreadable or too large."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    headers = []
    for f in files:
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > SAFETENSORS_HEADER_LIMIT:
                    return None
                header = json.loads(fh.read(n))
        except (OSError, struct.error, json.JSONDecodeError, ValueError):
            return None
        if not isinstance(header, dict):
            return None
        headers.append(header)
    return headers


def read_weight_bytes(model_dir: Path) -> tuple[int, str] | None:
    """Weight bytes from the index's total_size or the files' headers."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if isinstance(total, int) and total > 0:
                return total, "safetensors index"
        except (OSError, json.JSONDecodeError):
            pass
    headers = read_safetensors_headers(model_dir)
    if headers is None:
        return None
    try:
        return sum(safetensors_header_bytes(h) for h in headers), "safetensors headers"
    except (KeyError, ValueError, TypeError):
        return None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal configs keep the language model's shape in text_config.
    return config.get("text_config") or config


def params_from_config(config: dict[str, Any]) -> int | None:
    """Approximate parameter count of a decoder-only transformer (pure)."""
    c = _text_config(config)
    try:
        hidden = int(c["hidden_size"])
        layers = int(c["num_hidden_layers"])
        vocab = int(c["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    heads = int(c.get("num_attention_heads") or max(1, hidden // 128))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    inter = int(c.get("intermediate_size") or 4 * hidden)
    experts = int(c.get("num_local_experts") or c.get("num_experts") or 1)
    moe_inter = int(c.get("moe_intermediate_size") or inter)
    attention = hidden * head_dim * (heads * 2 + kv_heads * 2)
    mlp = 3 * hidden * (moe_inter * experts if experts > 1 else inter)
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp + 2 * hidden)


def bytes_per_param(config: dict[str, Any]) -> float:
    q = config.get("quantization") or config.get("quantization_config") or {}
    if isinstance(q, dict) and q.get("bits"):
        bits = int(q["bits"])
        group = int(q.get("group_size") or 64)
        return bits / 8 + 4 / group  # packed weights + a scale and bias per group (fp16)
    dtype = str(_text_config(config).get("torch_dtype") or config.get("torch_dtype") or "float16")
    return TORCH_DTYPE_BYTES.get(dtype, 2)


_PARAMS_IN_NAME = re.compile(r"(?<![0-9a-z.])(\d+(?:\.\d+)?)\s*b(?![a-z])", re.IGNORECASE)
_BITS_IN_NAME = re.compile(r"(\d+)[-_]?bit", re.IGNORECASE)
_MOE_IN_NAME = re.compile(r"(\d+)x(\d+(?:\.\d+)?)b", re.IGNORECASE)


def weights_from_name(name: str) -> int | None:
    """'Llama-3.3-70B-Instruct-4bit' -> ~39 GB (pure). None when no size is named."""
    base = name.rsplit("/", 1)[-1]
    moe = _MOE_IN_NAME.search(base)
    if moe:
        params = int(moe.group(1)) * float(moe.group(2)) * 1e9
    else:
        sizes = [float(m.group(1)) for m in _PARAMS_IN_NAME.finditer(base)]
        if not sizes:
            return None
        params = max(sizes) * 1e9  # "A3B"-style active counts are smaller than the total
    bits = _BITS_IN_NAME.search(base)
    per_param = (int(bits.group(1)) / 8 + 4 / 64) if bits else 2.0
    return int(params * per_param)


# --- KV cache --------------------------------------------------------------

KV_STEP = 256  # mlx-lm's KV caches hold whole steps of this many positions
KV_GROUP_SIZES = (128, 64, 32)  # what mx.quantize takes


@dataclass(frozen=True)
class KVLayout:
    """How a model's KV cache holds its values: `bits` 16 keeps the model's
    own dtype; 8 or 4 quantises keys and values (mlx-lm's QuantizedKVCache,
    a scale and a bias in the model's dtype per `group_size` values) once a
    request's cache holds `quantized_start` positions."""

    bits: int = 16
    group_size: int = 64
    quantized_start: int = 0
    # A request's KV buffer in coarse steps (`kv_allocated_tokens`): on MLX's CUDA backend, where decode
    # attention over a buffer of whole steps runs through cuDNN, which builds a graph per buffer length.
    coarse_steps: bool = False

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def key(self) -> str:
        """For cache keys: KV of one layout is never reused under another."""
        return "kv16" if not self.quantized else f"kv{self.bits}g{self.group_size}s{self.quantized_start}"


def kv_group(head_dim: int, configured: int) -> int | None:
    """The quantisation group for a head of `head_dim` values (pure): the
    configured size where it divides the head, else the largest smaller one
    that does; None where none does (the KV then stays unquantised)."""
    for size in KV_GROUP_SIZES:
        if size <= configured and head_dim % size == 0:
            return size
    return None


def _kv_shape(config: dict[str, Any]) -> tuple[int, int, int, int | None] | None:
    """(layers, kv heads, head dim, sliding window) of the text model, or None."""
    c = _text_config(config)
    try:
        hidden = int(c["hidden_size"])
        layers = int(c["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    heads = int(c.get("num_attention_heads") or max(1, hidden // 128))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    return layers, kv_heads, head_dim, int(window) if window else None


def model_dtype_bytes(config: dict[str, Any]) -> int:
    """Bytes of one activation value: float16/bfloat16 unless the config says float32."""
    dtype = str(_text_config(config).get("torch_dtype") or config.get("torch_dtype") or "float16")
    return 4 if dtype == "float32" else 2


def kv_layout_for(config: dict[str, Any] | None, bits: int, group_size: int, quantized_start: int) -> KVLayout:
    """The layout a model's KV gets from the settings (pure): quantised only
    where its head size takes a quantisation group; else the model's dtype."""
    shape = _kv_shape(config) if config and bits < 16 else None
    group = kv_group(shape[2], group_size) if shape else None
    return KVLayout(bits, group, quantized_start) if group else KVLayout()


def kv_value_bytes(dtype_bytes: int, layout: KVLayout) -> float:
    """Bytes one key or value element takes in the cache (pure)."""
    if not layout.quantized:
        return dtype_bytes
    return layout.bits / 8 + 2 * dtype_bytes / layout.group_size


def kv_cache_bytes(config: dict[str, Any], context_tokens: int, bytes_per_value: int | None = None,
                   layout: KVLayout = KVLayout()) -> int:
    """K and V for every layer over `context_tokens` positions (pure), in the
    model's activation dtype (float16 unless its config says float32) or as
    `layout` quantises them. Quantised from `quantized_start` on: until then
    the cache holds the model's dtype, and at the switch both copies are alive."""
    shape = _kv_shape(config)
    if shape is None:
        return 0
    layers, kv_heads, head_dim, window = shape
    dtype_bytes = bytes_per_value or model_dtype_bytes(config)
    positions = min(context_tokens, window) if window else context_tokens
    per_position = 2 * layers * kv_heads * head_dim
    if not layout.quantized:
        return per_position * positions * dtype_bytes
    quantised = int(per_position * positions * kv_value_bytes(dtype_bytes, layout))
    before_switch = per_position * min(positions, layout.quantized_start) * dtype_bytes
    return quantised + before_switch if positions > layout.quantized_start else before_switch


def kv_prefill_transient_bytes(config: dict[str, Any], context_tokens: int, layout: KVLayout) -> int:
    """What a prefill step holds beside a quantised cache (pure): the layer
    it attends over dequantised to the model's dtype (engine/cache/kv_cache.py's
    DequantizedView), two layers' worth, as MLX may free one while it
    computes the next. 0 at 16 bits (attention reads the cache itself)."""
    shape = _kv_shape(config)
    if not layout.quantized or shape is None:
        return 0
    return 2 * kv_cache_bytes(config, context_tokens) // shape[0]


COARSE_STEPS_PER_OCTAVE = 8  # coarse steps: an eighth of the power of two below the length (<= 12.5 % more)


def kv_allocated_tokens(tokens: int, coarse: bool = False) -> int:
    """Positions a request's KV is allocated for (pure): its length in whole
    steps of KV_STEP; `coarse` (KVLayout.coarse_steps), in steps of an eighth
    of the power of two below it, at least KV_STEP. On MLX's CUDA backend
    decode attention over a buffer of whole steps runs through cuDNN, which
    builds a graph for each buffer length it meets: 70-100 ms on the lent
    GPU, every row of the batch waiting (docs/BENCHMARKS.md). Rows' lengths
    in coarse steps meet few lengths: 8 an octave, each built once."""
    step = KV_STEP
    if coarse and tokens > KV_STEP:
        step = max(KV_STEP, (1 << ((tokens - 1).bit_length() - 1)) // COARSE_STEPS_PER_OCTAVE)
    return -(-tokens // step) * step


def vision_encoder_bytes(config: dict[str, Any], image_tokens: int) -> int:
    """Activations of a vision tower encoding images that become
    `image_tokens` tokens (pure): one layer's live tensors (residual, q/k/v,
    attention output, MLP hidden) over every patch, in float32, twice over
    (a layer's input and output coexist). Their KV is counted with the prompt;
    attention scores are not (MLX fuses attention). 0 without a vision tower."""
    v = config.get("vision_config")
    if not isinstance(v, dict) or image_tokens <= 0:
        return 0
    merge = int(v.get("spatial_merge_size") or v.get("merge_size") or 1)
    patches = image_tokens * merge * merge
    width = int(v.get("embed_dim") or v.get("hidden_size") or 1024)
    mlp_ratio = float(v.get("mlp_ratio") or (int(v.get("intermediate_size") or 4 * width) / width))
    return int(2 * patches * width * (5 + mlp_ratio) * 4)


# --- putting it together -----------------------------------------------------

def estimate_footprint(
    config: dict[str, Any] | None,
    weight_file_bytes: tuple[int, str] | None,
    name: str,
    context_tokens: int,
    layout: KVLayout = KVLayout(),
) -> Footprint:
    """Best estimate from what is known (pure)."""
    kv = kv_cache_bytes(config, context_tokens, layout=layout) if config else 0
    if weight_file_bytes is not None:
        return Footprint(weight_file_bytes[0], kv, weight_file_bytes[1])
    if config:
        params = params_from_config(config)
        if params is not None:
            return Footprint(int(params * bytes_per_param(config)), kv, "config shape")
    by_name = weights_from_name(name)
    if by_name is not None:
        # No config: assume a 10% KV allowance on top of the weights.
        return Footprint(by_name, by_name // 10, "model name")
    return Footprint(None, kv, "unknown")


def request_fits(budget_bytes: int, weights_bytes: int, request_kv_bytes: int, cache_bytes: int) -> tuple[bool, int]:
    """(whether a request's own KV — its prompt and answer — fits beside the
    model's weights in the budget, the bytes the prompt cache may keep
    meanwhile) (pure). The cache gives way first; a request that cannot fit
    even then is refused, never run into an out-of-memory abort."""
    room = budget_bytes - weights_bytes - request_kv_bytes
    return room >= 0, max(0, min(cache_bytes, room))


def prompt_cache_budget(budget_bytes: int, model_bytes: int | None, configured_bytes: int | None) -> int:
    """Memory for cached prompt KV beside a model (pure): what the model's
    estimate (weights + KV for its context) leaves of the budget, so the cache
    can never push a model that fits over the line; half of that unless
    configured. A model of unknown size is assumed to take half the budget."""
    model = budget_bytes // 2 if model_bytes is None else model_bytes
    left = max(0, budget_bytes - model)
    return left // 2 if configured_bytes is None else min(configured_bytes, left)


DISK_TIER_FLOOR_BYTES = 8 * GIB


def disk_tier_budget(configured_bytes: int | None, memory_tier_bytes: int, free_disk_bytes: int) -> int:
    """Disk for the prompt cache's entries (pure): as configured; unset, as
    much as its memory tier may hold (every turn is written behind, so a crash
    finds on disk whatever was in memory), at least 8 GiB -- but never more than
    a quarter of the disk that was free."""
    if configured_bytes is not None:
        return configured_bytes
    return max(0, min(max(DISK_TIER_FLOOR_BYTES, memory_tier_bytes), free_disk_bytes // 4))


def memory_budget(total_bytes: int, fraction: float) -> int:
    return int(total_bytes * fraction)


def matches_heavy_pattern(name: str, patterns: list[str]) -> str | None:
    lowered = name.lower()
    for p in patterns:
        if re.search(rf"(?<![0-9a-z.]){re.escape(p.lower())}(?![a-z0-9])", lowered):
            return p
    return None


def judge(name: str, footprint: Footprint, budget_bytes: int, heavy_patterns: list[str]) -> Verdict:
    """Admit or refuse a model (pure)."""
    total = footprint.total_bytes
    if total is None:
        pattern = matches_heavy_pattern(name, heavy_patterns)
        if pattern:
            return Verdict(False, f"model {name!r} matches the heavy pattern {pattern!r} and its size is unknown "
                                  f"(budget {budget_bytes / GIB:.1f} GiB)")
        return Verdict(True, f"size of {name!r} unknown; no heavy pattern matches")
    if total > budget_bytes:
        return Verdict(False, f"model {name!r} needs about {total / GIB:.1f} GiB "
                              f"(weights {footprint.weights_bytes / GIB:.1f} GiB from {footprint.source} + "
                              f"KV cache {footprint.kv_bytes / GIB:.1f} GiB), over the memory budget of "
                              f"{budget_bytes / GIB:.1f} GiB")
    return Verdict(True, f"model {name!r} needs about {total / GIB:.2f} GiB of {budget_bytes / GIB:.1f} GiB")
