"""The CPU's float32 path, second half: Linear and Embedding layers keep
their weight transposed.

A decoded token reads every weight once through a matrix-vector product.
MLX's `Linear` computes `x @ W.T`; OpenBLAS's product in that layout ran at
6.3 GB/s on 2 cores where `x @ W` ran at 13.0 (bench/cpu_path.py, docs/
BENCHMARKS.md), so the layout sets the decode speed: the default model in
process, 8.5 -> 10.5 tok/s. A tied output head (`embed_tokens.as_linear`,
the default model's, 21 % of its weights) is the same product: the embedding
is held transposed too, its lookup reading a column per token instead of a
row (no second copy). A prompt's matrix-matrix products are as fast either
way. Only the float32 CPU path uses it (engine/model_load.py
load_resident): on Metal and CUDA, and for quantised weights, MLX's own
kernels read `W` as stored.
"""

from __future__ import annotations

import os
from typing import Any

# MLX at import: engine/model_load.py imports this module inside its load,
# after the engine has chosen MLX's BLAS (tests/engine/test_import_order.py).
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

OPT_OUT_ENV = "MLXD_CPU_LAYOUT"  # "stored": keep MLX's layout (to compare: bench/cpu_path.py's after-stored arm)


def transposing() -> bool:
    return os.environ.get(OPT_OUT_ENV, "").strip().lower() != "stored"


class TransposedLinear(nn.Module):
    """`nn.Linear` with its weight held as `W.T`, contiguous."""

    def __init__(self, weight_t: Any, bias: Any = None) -> None:
        super().__init__()
        self.weight_t = weight_t
        if bias is not None:
            self.bias = bias

    @property
    def weight(self) -> Any:  # for code that reads a layer's shape or dtype
        return self.weight_t.T

    def __call__(self, x: Any) -> Any:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self["weight_t"])
        return x @ self["weight_t"]


class TransposedEmbedding(nn.Module):
    """`nn.Embedding` with its table held as `W.T`, contiguous."""

    def __init__(self, weight_t: Any) -> None:
        super().__init__()
        self.weight_t = weight_t

    @property
    def weight(self) -> Any:
        return self.weight_t.T

    def __call__(self, x: Any) -> Any:
        return mx.moveaxis(mx.take(self["weight_t"], x, axis=1), 0, -1)

    def as_linear(self, x: Any) -> Any:  # a tied output head
        return x @ self["weight_t"]


def transpose_linears(model: Any) -> int:
    """Every plain `nn.Linear` and `nn.Embedding` of the model replaced by
    its transposed kind (lazily: the copies are made when the weights are
    evaluated, and the stored ones let go). The number replaced."""

    def transposed(m: Any) -> Any:
        weight_t = mx.contiguous(m["weight"].T)
        return TransposedLinear(weight_t, m.get("bias")) if type(m) is nn.Linear else TransposedEmbedding(weight_t)

    replaced = [(name, transposed(m)) for name, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)
