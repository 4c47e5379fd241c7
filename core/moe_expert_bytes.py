"""A mixture-of-experts model's 16-bit routed experts, counted at float32
on MLX's CPU backend (pure, except `read_float16_expert_bytes`, which reads
file headers only).

MLX's CPU backend runs gather_mm -- the product of unquantised routed
experts (mlx-lm's SwitchLinear) -- in float32 only, so the engine casts
those modules' weights to float32 at load (engine/cpu/backend_ops.py): a
bf16 expert takes twice its stored bytes there. Quantised experts
(gather_qmm) and every other module stay as stored. Which tensors are routed
experts is read from their names, as mlx-lm's models and sanitize name them;
the model's estimate (mlxd.memory_estimate) then counts them twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxd.memory_estimate import Footprint, read_safetensors_headers

FLOAT16_DTYPES = frozenset({"F16", "BF16"})
# A path component under which mlx-lm gathers routed experts: HF's per-expert
# `experts.N.*` and stacked `experts.gate_up_proj`, mlx-lm's own `switch_mlp`
# (gemma4: `switch_glu`; gpt-oss, llama4, dots1, afmoe: `experts.gate_proj`).
# `shared_experts`/`shared_expert` and the router (`gate`, `router`) are other
# components: dense modules, never cast.
ROUTED_EXPERT_PARTS = frozenset({"experts", "switch_mlp", "switch_glu"})
# (parent, child) components naming stacked experts in a checkpoint as
# mlx-lm's sanitize reads them: granite's block_sparse_moe.input_linear /
# output_linear (its shared_mlp.input_linear is dense), step3p5's
# moe.gate_proj, phixtral's moe.mlp.N.
ROUTED_EXPERT_PAIRS = frozenset({("block_sparse_moe", "input_linear"), ("block_sparse_moe", "output_linear"),
                                 ("moe", "gate_proj"), ("moe", "up_proj"), ("moe", "down_proj"), ("moe", "mlp")})
# dbrx's experts are a list of dense MLPs (ffn.experts.mlp.w1 stacked in HF,
# ffn.experts.N.w1 in mlx-lm): plain matmuls, no gather_mm.
DENSE_EXPERT_PARENTS = frozenset({"ffn"})
_PARAM_SUFFIXES = ("weight", "bias", "scales", "biases")
_STACKED_SUFFIXES = ("_bias", "_blocks", "_scales")  # gpt-oss's gate_up_proj_bias, its mxfp4 _blocks/_scales


def is_routed_expert_tensor(name: str) -> bool:
    """Whether a checkpoint's tensor belongs to a model's routed experts, as
    mlx-lm loads them into SwitchLinear modules (pure). Tensors of
    multi-token-prediction heads (`mtp.*`) are dropped at load: not counted."""
    parts = name.split(".")
    if parts[0] == "mtp":
        return False
    for i, part in enumerate(parts):
        parent = parts[i - 1] if i else ""
        if part in ROUTED_EXPERT_PARTS and parent not in DENSE_EXPERT_PARENTS:
            return True
        if (parent, part) in ROUTED_EXPERT_PAIRS:
            return True
    return False


def tensor_module(name: str) -> str:
    """The module a tensor is a parameter of (pure): `a.b.weight` -> `a.b`;
    a stacked checkpoint tensor is its own (`experts.gate_up_proj`), with its
    suffix off (`experts.gate_up_proj_bias` -> `experts.gate_up_proj`)."""
    head, _, last = name.rpartition(".")
    if head and last in _PARAM_SUFFIXES:
        return head
    for suffix in _STACKED_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _quantised(module: str, header: dict[str, Any]) -> bool:
    """A module with quantisation scales beside its weight (mlx's `.scales`,
    gpt-oss's `_scales`), or whose weight is not a float (U32, U8, F8...)."""
    if f"{module}.scales" in header or f"{module}_scales" in header:
        return True
    weight = header.get(f"{module}.weight") or header.get(module)
    return isinstance(weight, dict) and weight.get("dtype") not in FLOAT16_DTYPES | {"F32", "F64"}


def float16_expert_bytes(header: dict[str, Any]) -> int:
    """Bytes of one safetensors header's routed-expert tensors stored as
    F16/BF16 (pure): the weights (and biases) the CPU backend's float32-only
    gather_mm has cast to float32, doubling them. Quantised experts
    (gather_qmm runs every dtype) and float32 ones add nothing."""
    total = 0
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict) or info.get("dtype") not in FLOAT16_DTYPES:
            continue
        if is_routed_expert_tensor(name) and not _quantised(tensor_module(name), header):
            start, end = info["data_offsets"]
            total += end - start
    return total


def read_float16_expert_bytes(model_dir: Path) -> int | None:
    """float16_expert_bytes over a folder's safetensors files (headers only),
    as one header: a shard's experts may have their scales in another.
    None when they cannot be read. GGUF files are not read: mlxd converts
    dense architectures only (core/gguf.py), and GGUF experts are almost
    always quantised anyway (gather_qmm: no cast)."""
    headers = read_safetensors_headers(model_dir)
    if headers is None:
        return None
    try:
        return float16_expert_bytes({k: v for h in headers for k, v in h.items() if k != "__metadata__"})
    except (KeyError, ValueError, TypeError):
        return None


EXPERTS_AS_FLOAT32 = "experts as float32 on the CPU"


def with_float32_experts(footprint: Footprint, float16_experts: int | None) -> Footprint:
    """A footprint with the model's float16/bfloat16 routed experts counted
    as float32 (pure): each of their 2-byte values takes 4, so the weights
    grow by the experts' stored bytes. Unknown or none: as it was."""
    if footprint.weights_bytes is None or not float16_experts:
        return footprint
    return Footprint(footprint.weights_bytes + float16_experts, footprint.kv_bytes,
                     f"{footprint.source} + {EXPERTS_AS_FLOAT32}")
