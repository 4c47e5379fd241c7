"""Attention over rows of any length, each with its own cache, in one forward.

mlx-lm batches rows of different lengths by padding them into one array and
masking the padding (BatchKVCache): every decode step then runs attention
with an explicit array mask, which backends fuse less well (MLX's CUDA
backend runs its unfused path: the scores materialised), over every row's
padding too. Here a decode step's input is the rows' last tokens, [B, 1],
and every matrix product of the model runs on them together, but each
layer's cache is a `RowsLayer`: each row's own cache (KVCache,
RotatingKVCache, QuantizedKVCache...) is updated with its row, and attention
is computed row by row over that row's own length, with MLX's fused kernel
and no mask. State-space layers (ArraysCache) are stacked for the step and
split back after it (`RowsArrays`). Rows whose caches share a prompt
prefix (engine/model/cascade_attention.py) attend in one call per prefix.

mlx-lm's models compute attention by calling
`mlx_lm.models.base.scaled_dot_product_attention(queries, keys, values,
cache, ...)`; each model module imports that function by name, so
`route_attention` points each loaded model module's name at
`attention_by_rows`, which hands a RowsLayer's attention to it and every
other call to mlx-lm's function unchanged. A model that uses the keys
itself (DeepSeek's latent attention) would compute something else, so
`rows_decode_exact` checks, once per load, that a step over two rows of
different lengths gives each row the logits it gets alone; a model that
fails it runs a forward a row (engine/model/row_batch.py, `apart`).
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models import base as mlx_lm_base

from .cascade_attention import SharedPrefixKVCache, attend_shared
from .row_segments import SegmentsLayer, forward_step, mixable, route_rope

log = logging.getLogger("mlxd.engine.core.worker")

_MLX_LM_ATTENTION = mlx_lm_base.scaled_dot_product_attention


class RowsLayer:
    """One attention layer's caches for a decode step over several rows."""

    def __init__(self, caches: list[Any], offsets: mx.array) -> None:
        self.caches = caches
        self.offset = offsets  # each row's position, for RoPE (MLX's rope takes one per row)
        self._fetched: list[tuple[Any, Any]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._fetched = [c.update_and_fetch(keys[i:i + 1], values[i:i + 1]) for i, c in enumerate(self.caches)]
        return keys, values  # not the context: attention reads each row's own (attend)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> None:
        return None  # each row's own (attend): none for one query, causal for a verify's few

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        # One query sees all its row's keys; a verify's n queries (the last token and a proposal) each see the
        # keys up to its own: MLX's "causal" aligns the queries to the end of the keys.
        # Rows over a shared prefix (SharedPrefixKVCache): one cascade call per prefix, which it reads once.
        mask = "causal" if queries.shape[2] > 1 else None
        # The cascade's grouping only where a row reads a shared prefix: the batch's rows own their KV otherwise.
        over_prefix = any(isinstance(c, SharedPrefixKVCache) for c in self.caches)
        shared = attend_shared(queries, self.caches, scale, sinks) if over_prefix else [None] * len(self.caches)
        rows = [out if out is not None else
                _MLX_LM_ATTENTION(queries[i:i + 1], k, v, cache=c, scale=scale, mask=mask, sinks=sinks)
                for i, ((k, v), c, out) in enumerate(zip(self._fetched, self.caches, shared))]
        self._fetched = []
        return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)


class RowsArrays:
    """One state-space layer's caches (ArraysCache) for a step: the rows'
    states stacked when the layer reads them, split back when it writes."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches
        self.lengths = None
        self.left_padding = None

    def __getitem__(self, idx: int) -> mx.array | None:
        states = [c[idx] for c in self.caches]
        if any(s is None for s in states):
            return None  # a row that has not started this state yet: the layer starts them all
        return states[0] if len(states) == 1 else mx.concatenate(states, axis=0)

    def __setitem__(self, idx: int, value: mx.array) -> None:
        for i, c in enumerate(self.caches):
            c[idx] = value[i:i + 1]

    def make_mask(self, n: int) -> None:
        return None

    def advance(self, n: int) -> None:
        for c in self.caches:
            c.advance(n)

    @property
    def batch_size(self) -> int:
        return len(self.caches)


def attention_by_rows(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
                      mask: mx.array | None, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's attention, except over a RowsLayer: row by row."""
    if isinstance(cache, (RowsLayer, SegmentsLayer)):
        return cache.attend(queries, scale, sinks)
    if isinstance(cache, SharedPrefixKVCache):  # a row over a shared prefix, alone
        return cache.attend(queries, keys, values, scale, mask, sinks)
    return _MLX_LM_ATTENTION(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def route_attention() -> None:
    """Every loaded mlx-lm model module's attention through attention_by_rows
    (idempotent; run after a model's load, which imports its module)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) \
                is _MLX_LM_ATTENTION:
            module.scaled_dot_product_attention = attention_by_rows


class RowsList:
    """One layer's CacheList (a hybrid layer's caches: state-space and attention) for a step."""

    def __init__(self, caches: list[Any], offsets: mx.array) -> None:
        self.caches = caches
        self.offsets = offsets

    def __getitem__(self, idx: int) -> Any:
        return rows_of([c[idx] for c in self.caches], self.offsets)


def rows_of(caches: list[Any], offsets: mx.array) -> Any:
    """The rows' caches of one layer as one cache for the step."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    if isinstance(caches[0], CacheList):
        return RowsList(caches, offsets)
    return RowsArrays(caches) if isinstance(caches[0], ArraysCache) else RowsLayer(caches, offsets)


def row_caches(kv_per_row: list[list[Any]], offsets: mx.array) -> list[Any]:
    """The step's layer caches: layer l of every row, as one cache."""
    return [rows_of([kv[l] for kv in kv_per_row], offsets) for l in range(len(kv_per_row[0]))]


def positions(kv_per_row: list[list[Any]]) -> mx.array:
    """Each row's position (the tokens its cache has seen), from its first cache that counts them."""
    out = []
    for kv in kv_per_row:
        layers = [c for layer in kv for c in (getattr(layer, "caches", None) or (layer,))]  # a CacheList's too
        counted = next((c for c in layers if isinstance(getattr(c, "offset", None), int)), None)
        out.append(counted.offset if counted is not None else 0)
    return mx.array(out, dtype=mx.int32)


def rows_decode_exact(model: Any, tolerance: float | None = None) -> tuple[bool, bool]:
    """Whether a step over two rows of different lengths, each with its own
    cache, gives each row the logits it gets alone: (a decode step of one
    token a row, a verify step of three). Checked once a load, on a few
    tokens; any error: not exact."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    route_attention()
    try:
        if tolerance is None:  # a half-precision product of one row and of two differ in their last bits
            tolerance = 1e-3 if model_dtype(model) == mx.float32 else 5e-2
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
        caches = [_check_cache(model) for _ in prompts]
        for prompt, cache in zip(prompts, caches):
            model(mx.array([prompt]), cache=cache)
        alone = copy.deepcopy(caches)
        decode = _same_as_alone(model, caches, alone, [[11], [12]], tolerance)
        verify = decode and can_trim_prompt_cache(caches[0]) and \
            _same_as_alone(model, caches, alone, [[13, 14, 15], [16, 17, 18]], tolerance)
        return decode, verify
    except Exception as exc:  # a model whose attention does not go through mlx-lm's function as it should
        log.info("decoding rows apart does not run for this model (%s: %s): a forward a row instead",
                 type(exc).__name__, exc)
        return False, False


def segments_exact(model: Any, tolerance: float | None = None) -> bool:
    """Whether a step over two decoding rows and a chunk gives each row the
    logits it gets alone (checked once a load, on a few tokens; any error:
    not exact). A model whose caches are not all plain KVCaches: False."""
    route_attention()
    route_rope()
    try:
        caches = [_check_cache(model) for _ in range(3)]
        if not mixable(caches):
            return False
        if tolerance is None:  # a half-precision product over more rows differs in its last bits
            tolerance = 1e-3 if model_dtype(model) == mx.float32 else 5e-2
        for prompt, cache in zip(([1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [20, 21]), caches):
            model(mx.array([prompt]), cache=cache)
        alone = copy.deepcopy(caches)
        segments = ([11], [12], [23, 24, 25, 26, 27])
        tokens = mx.array([t for s in segments for t in s], dtype=mx.int32)
        # The decoding rows' logits, and the chunk's keys and values, against each row's alone.
        together = forward_step(model, caches, tokens, [len(s) for s in segments], 2).astype(mx.float32)
        each = mx.concatenate([model(mx.array([s]), cache=c)[:, -1] for s, c in zip(segments, alone)]).astype(mx.float32)
        worst = float(mx.abs(together - each[:2]).max()) / (float(mx.abs(each[:2]).max()) + 1e-6)
        for mixed, own in zip(caches[2], alone[2]):
            for a, b in zip(mixed.state[:2], own.state[:2]):  # (keys, values)
                worst = max(worst, float(mx.abs(a - b).max()) / (float(mx.abs(b).max()) + 1e-6))
        exact = worst <= tolerance and bool(mx.all(together.argmax(-1) == each[:2].argmax(-1)))
        if not exact:
            log.info("a step of decoding rows and a prompt chunk is not exact for this model (worst %.3g of the "
                     "logits' scale): joining prompts are prefilled apart", worst)
        return exact
    except Exception as exc:  # a model whose positions or attention do not go through the cache's as they should
        log.info("a step of decoding rows and a prompt chunk does not run for this model (%s: %s): joining "
                 "prompts are prefilled apart", type(exc).__name__, exc)
        return False


def _check_cache(model: Any) -> list[Any]:
    """A cache for a load's check, grown 16 positions at a time (mlx-lm's 256 would hold a big model's memory)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for c in cache:
        if hasattr(c, "step"):
            c.step = 16
    return cache


def _same_as_alone(model: Any, caches: list[list[Any]], alone: list[list[Any]], tokens: list[list[int]],
                   tolerance: float) -> bool:
    together = model(mx.array(tokens), cache=row_caches(caches, positions(caches))).astype(mx.float32)
    each = mx.concatenate([model(mx.array([t]), cache=c) for t, c in zip(tokens, alone)], axis=0).astype(mx.float32)
    worst = float(mx.abs(together - each).max()) / (float(mx.abs(each).max()) + 1e-6)
    exact = worst <= tolerance and bool(mx.all(together.argmax(-1) == each.argmax(-1)))
    if not exact:
        log.info("decoding rows apart (%d tokens a row) is not exact for this model (worst %.3g of the logits' "
                 "scale): %s", len(tokens[0]), worst,
                 "a forward a row instead" if len(tokens[0]) == 1 else "no prompt lookup in a batch of several")
    return exact


def model_dtype(model: Any) -> Any:
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32
