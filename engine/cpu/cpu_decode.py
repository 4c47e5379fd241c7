"""The CPU's float32 path, third part: a decoded token in fewer MLX ops,
and the path's one entry, `prepare_float32`, which the model load calls.

On the CPU every MLX op costs its dispatch (building the array, the
scheduler's hand-off to the stream's thread, an allocation) whatever its
size, and a one-token step spent most of its ops in MLX's CPU fallbacks of
`fast.rope` (the frequencies recomputed every call), `fast.rms_norm` and
`fast.scaled_dot_product_attention` (the query heads repeated over the KV
heads); on 2 cores that overhead took as much time as reading the weights
(docs/BENCHMARKS.md, "The CPU path's layouts"). Three replacements for one
token cut the step's ops to about a quarter, each falling back to MLX's own
op for a prompt (many tokens: compute-bound, the dispatch negligible) and
for what it does not know:
- `RotationRoPE`: a token at position p is rotated by one matrix product,
  the matrix built once per position (numpy) and shared by every layer;
- `CompiledRMSNorm`: the norm as one compiled kernel and a sum;
- `FoldedLlamaAttention`, `FoldedQwen2Attention`: mlx-lm's attention, whose
  one-token step folds the query heads that share a KV head into rows of one
  product (3 matmuls of 3 rows instead of 9 of 1) with no mask or repeat;
  its query, key and value projections one product (`share_qkv`,
  engine/cpu/cpu_linear.py's SharedInputProduct: a prompt through mlx-lm's
  own code shares it too).
Only the CPU's float32 path uses them (engine/model/model_load.py, through
`prepare_float32`), with engine/cpu/cpu_linear.py's transposed layout.
"""

from __future__ import annotations

from functools import partial
from typing import Any

# MLX at import: imported only inside the model load, after the BLAS is chosen.
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import KVCache

from .cpu_linear import (SharedInputProduct, StoredLinear, TransposedLinear, prompt_streams, transpose_linears,
                         usable_cores)


def rotation_matrix(position: int, dims: int, head_dim: int, base: float, scale: float,
                    traditional: bool) -> np.ndarray:
    """R with x @ R == RoPE(x) for a row x of one head at `position` (pure):
    the first `dims` features rotated in pairs (i, i + dims/2), or adjacent
    pairs when `traditional`, at angle position * scale * base^(-2i/dims);
    the rest passed through."""
    half = dims // 2
    theta = position * scale * base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    cos, sin = np.cos(theta), np.sin(theta)
    r = np.eye(head_dim, dtype=np.float64)
    first = np.arange(half) * 2 if traditional else np.arange(half)
    second = first + 1 if traditional else first + half
    r[first, first], r[second, second] = cos, cos
    r[second, first], r[first, second] = -sin, sin
    return r.astype(np.float32)


class RotationRoPE(nn.Module):
    """`nn.RoPE` whose one-token call is a product with a rotation matrix."""

    _made: dict[tuple, Any] = {}  # every layer of a step asks for the same matrices (the worker thread's)

    def __init__(self, rope: nn.RoPE) -> None:
        super().__init__()
        self.dims, self.traditional, self.base, self.scale = rope.dims, rope.traditional, rope.base, rope.scale

    def rotation(self, position: int, head_dim: int, factor: float = 1.0) -> Any:
        """R (1 x head_dim x head_dim) for `position`, times `factor` (the
        attention's scale, folded into the queries' rotation)."""
        key = (position, head_dim, factor, self.dims, self.traditional, self.base, self.scale)
        hit = RotationRoPE._made.get(key)
        if hit is None:
            if len(RotationRoPE._made) >= 4:  # a step asks for 2 (queries, keys): the older ones are done
                RotationRoPE._made.clear()
            r = rotation_matrix(position, self.dims, head_dim, self.base, self.scale, self.traditional) * factor
            hit = RotationRoPE._made[key] = mx.array(r[None])
        return hit

    def __call__(self, x: Any, offset: Any = 0) -> Any:
        if isinstance(offset, int) and x.shape[-2] == 1 and x.dtype == mx.float32:
            return x @ self.rotation(offset, x.shape[-1])[0]
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
                            offset=offset)


@partial(mx.compile, shapeless=True)  # one kernel for a token and a prompt alike
def _rms_norm(x: Any, weight: Any, eps: float, inv_n: float) -> Any:
    # eps and 1/n are constants of the kernel (a shapeless mean would count its elements: one op more a call)
    return x * mx.rsqrt(mx.sum(mx.square(x), axis=-1, keepdims=True) * inv_n + eps) * weight


class CompiledRMSNorm(nn.Module):
    """`nn.RMSNorm` (float32) as one compiled kernel and a sum."""

    def __init__(self, norm: nn.RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def __call__(self, x: Any) -> Any:
        if x.dtype != mx.float32:
            return mx.fast.rms_norm(x, self["weight"], self.eps)
        return _rms_norm(x, self["weight"], self.eps, 1.0 / x.shape[-1])


def _folded_attention(attn: Any, x: Any, cache: Any) -> Any:
    """One token of mlx-lm's Llama / Qwen2 attention (x: 1 x 1 x hidden)."""
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    if "qkv_proj" in attn:  # one product for the three
        both = attn.qkv_proj(x)
        queries, keys, values = (both[..., a:b] for a, b in attn.qkv_proj.bounds)
    else:
        queries, keys, values = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    head_dim = queries.shape[-1] // heads
    if isinstance(attn.rope, RotationRoPE):  # heads as rows of one product with the position's rotation
        queries = queries.reshape(1, heads, head_dim) @ attn.rope.rotation(cache.offset, head_dim, attn.scale)
        keys = keys.reshape(1, kv_heads, head_dim) @ attn.rope.rotation(cache.offset, head_dim)
    else:  # one token: (B, L, H, D) -> (B, H, L, D) is a reshape
        queries = attn.rope(queries.reshape(1, heads, 1, head_dim), offset=cache.offset) * attn.scale
        keys = attn.rope(keys.reshape(1, kv_heads, 1, head_dim), offset=cache.offset)
    keys, values = cache.update_and_fetch(keys.reshape(1, kv_heads, 1, head_dim),
                                          values.reshape(1, kv_heads, 1, head_dim))
    # The query heads that share a KV head are rows of one product.
    queries = queries.reshape(1, kv_heads, heads // kv_heads, head_dim)
    weights = mx.softmax(queries @ keys.swapaxes(-1, -2), axis=-1)
    return attn.o_proj((weights @ values).reshape(1, 1, -1))


def _one_token(x: Any, mask: Any, cache: Any) -> bool:
    return (x.shape[0] == 1 and x.shape[1] == 1 and mask is None and x.dtype == mx.float32
            and isinstance(cache, KVCache) and isinstance(cache.offset, int))


class _FoldedCall:
    """The one-token shortcut in front of mlx-lm's own attention."""

    def __call__(self, x: Any, mask: Any = None, cache: Any = None) -> Any:
        if _one_token(x, mask, cache):
            return _folded_attention(self, x, cache)
        return super().__call__(x, mask, cache)  # type: ignore[misc]


class FoldedLlamaAttention(_FoldedCall, llama.Attention):
    pass


class FoldedQwen2Attention(_FoldedCall, qwen2.Attention):
    pass


FOLDED = {llama.Attention: FoldedLlamaAttention, qwen2.Attention: FoldedQwen2Attention}


def _shareable(attn: Any) -> bool:
    """Query, key and value projections as stored or transposed (the
    product's own kinds), with biases on all three or none."""
    layers = (attn.q_proj, attn.k_proj, attn.v_proj)
    return (all(type(m) in (nn.Linear, StoredLinear, TransposedLinear) for m in layers)
            and len({"bias" in m for m in layers}) == 1)


def share_qkv(attn: Any) -> None:
    """The attention's query, key and value projections as one product
    (engine/cpu/cpu_linear.py's SharedInputProduct)."""
    shared = SharedInputProduct([attn.q_proj, attn.k_proj, attn.v_proj])
    attn.qkv_proj = shared
    attn.q_proj, attn.k_proj, attn.v_proj = shared.layer(0), shared.layer(1), shared.layer(2)


def shorten_decode(model: Any) -> int:
    """The model's RoPE, RMSNorm and Llama / Qwen2 attention modules given
    their one-token shortcuts (the attention's projections as one product
    where `_shareable`). The number of modules changed."""
    replaced, changed = [], 0
    for name, m in model.named_modules():
        if type(m) is nn.RoPE:
            replaced.append((name, RotationRoPE(m)))
        elif type(m) is nn.RMSNorm:
            replaced.append((name, CompiledRMSNorm(m)))
        elif type(m) in FOLDED:
            m.__class__ = FOLDED[type(m)]  # the same module and parameters; only __call__ differs
            if _shareable(m):
                share_qkv(m)
            changed += 1
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced) + changed


def prepare_float32(model: Any) -> str:
    """The CPU's float32 path on a model already cast to float32 (the one
    call engine/model/model_load.py makes into it): the weights laid out as
    OpenBLAS reads them fastest (engine/cpu/cpu_linear.py: a layer held
    transposed where it widens, a prompt's rows on a stream per core, at
    most two) and a decoded token's shortcuts (shorten_decode). What it did,
    for the log."""
    streams = prompt_streams(usable_cores())
    transpose_linears(model, streams)
    shorten_decode(model)  # a decoded token in a quarter of the MLX ops
    return f"transposed, a prompt's rows on {streams} CPU stream(s)"
