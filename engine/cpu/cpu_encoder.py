"""The CPU's encoder path: BERT-family embedding models without MLX's slow
transcendental kernels.

On MLX's CPU backend `exp` and `erf` are scalar loops (~12-24 ns an element
on this project's Linux machines): in all-MiniLM-L6-v2 the attention's
softmax and the MLP's GELU took 60 % of a forward while the matmuls
(OpenBLAS) took the rest. Both are replaced by compiled polynomials built
from multiplies and adds, which MLX fuses into one loop: exp by Cody-Waite
range reduction and a degree-6 polynomial with the exponent set by its bits
(relative error < 1e-6), erf by Eigen's rational approximation (absolute
error < 2e-6). Entered only from the encoder's load (engine/model/encoder.py)
on the CPU; on Metal and CUDA MLX's own kernels are fast and none of it runs.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.bert.bert import BertLayer, BertSelfAttention

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)
# Eigen's generic_fast_erf_float: erf(x) = x P(x^2) / Q(x^2) on [-4, 4].
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def _exp(x: mx.array) -> mx.array:
    x = mx.clip(x, -87.0, 88.0)
    n = mx.floor(x * _LOG2E + 0.5)
    r = x - n * _LN2_HI - n * _LN2_LO
    p = _EXP_POLY[0]
    for c in _EXP_POLY[1:]:
        p = p * r + c
    p = p * r * r + r + 1.0
    return p * mx.view(mx.left_shift((n + 127).astype(mx.int32), 23), mx.float32)  # 2^n from its bits


def _softmax(x: mx.array) -> mx.array:
    e = _exp(x - mx.max(x, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


def _gelu(x: mx.array) -> mx.array:
    z = mx.clip(x * 0.7071067811865476, -4.0, 4.0)
    z2 = z * z
    p = _ERF_P[0]
    for c in _ERF_P[1:]:
        p = p * z2 + c
    q = _ERF_Q[0]
    for c in _ERF_Q[1:]:
        q = q * z2 + c
    return 0.5 * x * (1.0 + z * p / q)


# One compiled graph per shape (the bit cast needs shapes); lengths come in buckets (engine/model/encoder.py).
fast_exp = mx.compile(_exp)
fast_softmax = mx.compile(_softmax)
fast_gelu = mx.compile(_gelu, shapeless=True)


class FastGELU(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return fast_gelu(x)


def _attention(self: Any, hidden_states: mx.array, mask: mx.array | None = None) -> mx.array:
    """mlx-vlm's BertSelfAttention with the softmax above."""
    B, L, _ = hidden_states.shape
    q = self._shape(self.query(hidden_states), B, L)
    k = self._shape(self.key(hidden_states), B, L)
    v = self._shape(self.value(hidden_states), B, L)
    scores = (q * self.scale) @ k.transpose(0, 1, 3, 2)
    if mask is not None:
        scores = scores + mask
    out = fast_softmax(scores) @ v
    return out.transpose(0, 2, 1, 3).reshape(B, L, self.all_head_size)


def prepare_encoder(model: Any) -> int:
    """The model's BERT layers given the fast kernels; how many layers (0:
    another architecture, left as it is)."""
    class FastBertSelfAttention(BertSelfAttention):
        __call__ = _attention

    layers = [m for _, m in model.named_modules() if isinstance(m, BertLayer)]
    for layer in layers:
        layer.attention.self.__class__ = FastBertSelfAttention
        if isinstance(layer.intermediate.intermediate_act_fn, nn.GELU):
            layer.intermediate.intermediate_act_fn = FastGELU()
    return len(layers)
