"""What each op of a model runs in on this backend, decided once at load.

MLX's backends do not run every op in every dtype: on the CPU backend
(mlx 0.32), `gather_mm` -- the product of a mixture-of-experts layer's
SwitchLinear experts (SwitchGLU) -- runs float32 only ("[GatherMM::eval]
Currently only supports float32"), while `gather_qmm` (quantised experts,
bf16 or f16 scales included), matmul, quantized_matmul, conv1d and fused
attention run bf16 and f16 too (checked op by op on mlx-cpu 0.32.4). A
bf16 MoE model loaded as stored would die at its first forward; so the
weights of the modules whose op the backend cannot run in their dtype are
cast to float32, and nothing else: "the weights as stored" still holds for
every other module.

`weights_plan` is the decision (pure, table-tested): from the backend, the
ops the model's modules call and their weights' dtypes, and the registry's
whole-model float32 verdict (the fast BLAS found, `cpu_float32`, the size:
fast_blas.weights_dtype_on_cpu). `model_ops` reads a model's modules and
`cast_modules` applies the plan, on the worker thread at load
(engine/model/model_load.py). The memory estimate counts that cast before
the load (mlxd.moe_expert_bytes.float16_expert_bytes, by tensor names): an
op added to OP_DTYPES needs its weights counted there too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

FLOAT32 = "float32"
# (backend, op) -> the weight dtypes the backend runs the op in; an op absent here runs in every dtype.
OP_DTYPES: dict[tuple[str, str], frozenset[str]] = {
    ("cpu", "gather_mm"): frozenset({FLOAT32}),
}
# A module class (by name: mlx-lm's) -> the op its forward calls on its weight.
MODULE_OPS = {"SwitchLinear": "gather_mm", "QuantizedSwitchLinear": "gather_qmm", "Linear": "matmul",
              "QuantizedLinear": "quantized_matmul", "Embedding": "take", "QuantizedEmbedding": "take"}


@dataclass(frozen=True)
class WeightsPlan:
    """The dtype each module's weights are loaded in."""

    whole: str | None  # the whole model cast (dequantised first) to this dtype; None: as stored
    cast_ops: tuple[str, ...] = ()  # ops whose modules' weights are cast to float32: the backend runs nothing else
    why: str = "as stored"  # for the load's log


def runs_in(backend: str, op: str, dtype: str) -> bool:
    """Whether `backend` runs `op` on weights of `dtype` (pure)."""
    allowed = OP_DTYPES.get((backend, op))
    return allowed is None or dtype in allowed


def weights_plan(backend: str, ops: dict[str, frozenset[str]], whole_float32: bool) -> WeightsPlan:
    """The dtype of each module's weights (pure). `ops`: op -> the dtypes of
    the weights of the modules that call it; `whole_float32`: the registry's
    verdict that the whole model runs fastest as float32 (the CPU's fast
    path). A whole float32 model runs every op; else the modules whose op
    the backend cannot run in their dtype are cast to float32, whatever the
    verdict (`cpu_float32 = false` included), and the rest stay as stored."""
    if whole_float32:
        return WeightsPlan(FLOAT32, (), "float32: the CPU's fast path")
    cast = tuple(sorted(op for op, dtypes in ops.items() if any(not runs_in(backend, op, d) for d in dtypes)))
    if not cast:
        return WeightsPlan(None)
    limits = ", ".join(f"{op} in {'/'.join(sorted(OP_DTYPES[(backend, op)]))} only" for op in cast)
    return WeightsPlan(None, cast, f"as stored, but the weights of the modules that call {', '.join(cast)} as "
                                   f"float32 (the {backend} backend runs {limits})")


def backend_of(device: Any) -> str:
    """"cpu" or "gpu" (Metal, CUDA) for an mlx device."""
    return "cpu" if "cpu" in str(device).lower() else "gpu"


def model_ops(model: Any) -> dict[str, frozenset[str]]:
    """op -> the dtypes of the weights of the modules that call it (by MODULE_OPS)."""
    found: dict[str, set[str]] = defaultdict(set)
    for _, module in model.named_modules():
        op = MODULE_OPS.get(type(module).__name__)
        weight = module.get("weight") if hasattr(module, "get") else None
        if op is not None and weight is not None:
            found[op].add(str(weight.dtype).rpartition(".")[2])
    return {op: frozenset(dtypes) for op, dtypes in found.items()}


def cast_modules(model: Any, ops: tuple[str, ...]) -> int:
    """The floating weights of every module that calls one of `ops`, as
    float32 (lazily: the load evaluates them); the bytes they take now."""
    total = 0
    for _, module in model.named_modules():
        if MODULE_OPS.get(type(module).__name__) in ops:
            module.set_dtype(mx.float32)  # floating parameters only: quantised ones stay
            total += sum(a.size * a.itemsize for _, a in tree_flatten(module.parameters()))
    return total
