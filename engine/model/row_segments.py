"""A step over rows' segments of different lengths in one forward: the
decoding rows' next tokens and the joining rows' prompt chunks together
(vLLM's chunked prefill: a token budget a step, the decode tokens first).

Prefilled by itself between two decode steps, a joining row's chunk holds
the decoding rows for its whole forward, and the decode step after it reads
the model's weights again for a few tokens. Here the step's tokens are one
sequence, [1, T]: each decoding row's one token, then each joining row's
chunk. Every matrix product runs over the T tokens at once (the weights
read once for both), and what depends on a token's row is split by segment:

- RoPE. mlx-lm's models pass their cache's `offset` to their RoPE, which
  calls `mx.fast.rope`. A step's offset is a `SegmentOffsets`, and
  `route_rope` points `mx.fast.rope` at `rope_by_segments`, which rotates
  the decoding rows' tokens in one call (MLX takes one offset a batch row)
  and each chunk in one call from its own position. Any other offset goes
  to MLX's function unchanged.
- The cache update and attention (`SegmentsLayer`): each row's segment goes
  to its own cache, and its queries attend to its own keys (a chunk's
  causally, with MLX's fused kernel, as a prefill alone does).

Only rows whose every layer is a plain KVCache mix (`mixable`): a rotating
window's or a state-space layer's step reads across the sequence, and
quantised KV is quantised as a prefill goes. row_attention.py's
`segments_exact` checks, once a load, that a mixed step gives each row the logits it gets alone (a model
that builds positions of its own from the offset would not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import KVCache

_MLX_ROPE = mx.fast.rope
_MLX_LM_ATTENTION = mlx_lm_base.scaled_dot_product_attention


@dataclass(frozen=True)
class SegmentOffsets:
    """Each segment's first position and length in a step's one sequence;
    the first `singles` segments are one token each (decoding rows)."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def singles(self) -> int:
        n = 0
        while n < len(self.lengths) and self.lengths[n] == 1:
            n += 1
        return n

    def bounds(self) -> list[tuple[int, int]]:
        """Each segment's [start, end) in the step's sequence."""
        out, start = [], 0
        for length in self.lengths:
            out.append((start, start + length))
            start += length
        return out


def rope_by_segments(a: mx.array, dims: int, *args: Any, offset: Any = 0, **kwargs: Any) -> mx.array:
    """`mx.fast.rope`, and over a step's segments where the offset says so
    (`a`: [1, heads, T, D], the sequence on the second axis from the end)."""
    if not isinstance(offset, SegmentOffsets):
        return _MLX_ROPE(a, dims, *args, offset=offset, **kwargs)
    parts, n = [], offset.singles
    if n:  # the decoding rows' tokens as a batch of n one-token rows, each at its own position
        singles = a[:, :, :n, :].transpose(2, 1, 0, 3)
        rotated = _MLX_ROPE(singles, dims, *args, offset=mx.array(offset.offsets[:n], dtype=mx.int32), **kwargs)
        parts.append(rotated.transpose(2, 1, 0, 3))
    for (start, end), first in zip(offset.bounds()[n:], offset.offsets[n:]):
        parts.append(_MLX_ROPE(a[:, :, start:end, :], dims, *args, offset=first, **kwargs))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def route_rope() -> None:
    """`mx.fast.rope` through rope_by_segments (idempotent)."""
    if mx.fast.rope is not rope_by_segments:
        mx.fast.rope = rope_by_segments


class SegmentsLayer:
    """One attention layer's caches for a step over segments: each row's own."""

    def __init__(self, caches: list[Any], offsets: SegmentOffsets) -> None:
        self.caches = caches
        self.offset = offsets  # read by the model's RoPE (rope_by_segments)
        self._bounds = offsets.bounds()
        self._fetched: list[tuple[Any, Any]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._fetched = [c.update_and_fetch(keys[:, :, s:e], values[:, :, s:e])
                         for c, (s, e) in zip(self.caches, self._bounds)]
        return keys, values  # not the context: attention reads each row's own (attend)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> None:
        return None  # each row's own (attend): none for one query, causal for a chunk

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        # A chunk's queries each see the keys up to their own: MLX's "causal" aligns them to the end of the keys.
        # Each segment's queries are copied out of the step's (a few KiB): as a view their strides carry the step's
        # length, and MLX's CUDA backend keys cuDNN's attention graphs by strides -- a graph built anew for every
        # decoding row at every step of a new length (70-150 ms each, bench/mixed_step_probe.py).
        rows = [_MLX_LM_ATTENTION(mx.contiguous(queries[:, :, s:e]), k, v, cache=c, scale=scale,
                                  mask="causal" if e - s > 1 else None, sinks=sinks)
                for (k, v), c, (s, e) in zip(self._fetched, self.caches, self._bounds)]
        self._fetched = []
        return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=2)


def mixable(kv_per_row: Sequence[list[Any]]) -> bool:
    """Whether these rows' caches may share a step of segments: every layer a plain KVCache."""
    return all(isinstance(c, KVCache) for kv in kv_per_row for c in kv)


def segment_caches(kv_per_row: Sequence[list[Any]], lengths: Sequence[int]) -> list[SegmentsLayer]:
    """The step's layer caches: layer l of every row, its segment `lengths[i]` tokens."""
    offsets = SegmentOffsets(tuple(kv[0].offset for kv in kv_per_row), tuple(lengths))
    return [SegmentsLayer([kv[l] for kv in kv_per_row], offsets) for l in range(len(kv_per_row[0]))]


class _FirstPositions:
    """An output projection (a Linear, or a tied Embedding's `as_linear`)
    over the first `n` positions of its input only: a step's logits for its
    decoding rows, not for every chunk token (mlx-lm's own prefill leaves
    them unevaluated; a step that reads some logits would compute all)."""

    def __init__(self, projection: Any, n: int) -> None:
        self.projection = projection
        self.n = n

    def __call__(self, x: mx.array) -> mx.array:  # a Linear (lm_head); as an Embedding: its lookup, unchanged
        return self.projection(x) if x.dtype in (mx.int32, mx.uint32) else self.projection(x[:, :self.n])

    def as_linear(self, x: mx.array) -> mx.array:
        return self.projection.as_linear(x[:, :self.n])


def _output_projection(model: Any) -> tuple[Any, str] | None:
    """Where the model's output projection hangs (its owner and key), as
    mlx-lm's models name it: `lm_head`, or the tied `model.embed_tokens`."""
    if "lm_head" in model:
        return model, "lm_head"
    inner = model.get("model")
    if inner is not None and "embed_tokens" in inner and hasattr(inner["embed_tokens"], "as_linear"):
        return inner, "embed_tokens"
    return None


def forward_segments(model: Any, kv_per_row: Sequence[list[Any]], tokens: mx.array,
                     lengths: Sequence[int]) -> mx.array:
    """The model over the step's sequence of int32 `tokens`, row i's segment
    `lengths[i]` tokens into its own cache: the logits [1, T, vocab]."""
    if len(lengths) == 1:
        return model(tokens[None], cache=kv_per_row[0])
    return model(tokens[None], cache=segment_caches(kv_per_row, lengths))


def forward_step(model: Any, kv_per_row: Sequence[list[Any]], tokens: mx.array, lengths: Sequence[int],
                 rows: int) -> mx.array:
    """A step's forward (`forward_segments`) whose first `rows` segments
    are decoding rows' tokens: their logits [rows, vocab], the chunks' not
    computed where the model's output projection is found."""
    at = _output_projection(model)
    projection = at[0][at[1]] if at is not None else None
    if at is not None:
        at[0][at[1]] = _FirstPositions(projection, rows)  # for this call only (the same weights)
    try:
        return forward_segments(model, kv_per_row, tokens, lengths)[0, :rows, :]
    finally:
        if at is not None:
            at[0][at[1]] = projection
