"""The KV cache a request decodes into: allocated once, at the length
admission granted, and quantised where `kv_bits` says so.

mlx-lm's KVCache and QuantizedKVCache grow in steps of 256 positions by
concatenating a longer array: memory climbs a staircase during a long
generation, and at each step the old array and the new one are both alive.
Admission (the worker's `_room_beside`) already counts a request's KV at its
full length (prompt + max_tokens), so the engine allocates exactly that, in
whole steps, before the first token: memory stays flat, and what admission
counted is what is used. The two subclasses differ from mlx-lm's classes only
in where their first array comes from; attention, trimming and saving are
mlx-lm's.

`kv_bits` 8 or 4 keeps keys and values quantised (mlx-lm's QuantizedKVCache:
per group of values a scale and a bias in the model's dtype), about half or a
quarter of the memory. Layers mlx-lm cannot quantise (a rotating window,
recurrent state) keep the model's dtype, and `unquantised_kinds` names them
for the log. All of it runs on the worker thread.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlxd.memory_estimate import KVLayout, kv_allocated_tokens


def _quantised_zeros(prefix: tuple[int, ...], dim: int, dtype: Any, group_size: int, bits: int) -> tuple:
    """The (packed values, scales, biases) arrays of mx.quantize for `prefix` + (dim,) values."""
    per_word = 32 // bits
    return (mx.zeros((*prefix, dim // per_word), dtype=mx.uint32),
            mx.zeros((*prefix, dim // group_size), dtype=dtype),
            mx.zeros((*prefix, dim // group_size), dtype=dtype))


class AllocatedKVCache(KVCache):
    """mlx-lm's KVCache whose array is allocated once, at `capacity`
    positions (in whole steps), by its first update."""

    def __init__(self, capacity: int, coarse: bool = False) -> None:
        super().__init__()
        self.capacity = capacity
        self.coarse = coarse  # KVLayout.coarse_steps

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            B, heads, n, k_dim = keys.shape
            length = kv_allocated_tokens(max(self.capacity, n), self.coarse)
            self.keys = mx.zeros((B, heads, length, k_dim), keys.dtype)
            self.values = mx.zeros((B, heads, length, values.shape[3]), values.dtype)
        return super().update_and_fetch(keys, values)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "AllocatedQuantizedKVCache":
        """Quantised into arrays of the same capacity (mlx-lm's `maybe_quantize_kv_cache`
        calls this once the cache reaches `quantized_kv_start`)."""
        out = AllocatedQuantizedKVCache(max(self.capacity, self.keys.shape[2] if self.keys is not None else 0),
                                        group_size, bits, self.coarse)
        if self.keys is not None:
            out.allocate(self.keys, self.values)
            n = self.offset
            for target, source in ((out.keys, self.keys), (out.values, self.values)):
                for part, q in zip(target, mx.quantize(source[..., :n, :], group_size=group_size, bits=bits)):
                    part[..., :n, :] = q
            out.offset = n
        return out


class AllocatedQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's QuantizedKVCache whose arrays are allocated once, at
    `capacity` positions (in whole steps), by its first update."""

    def __init__(self, capacity: int, group_size: int, bits: int, coarse: bool = False) -> None:
        super().__init__(group_size=group_size, bits=bits)
        self.capacity = capacity
        self.coarse = coarse  # KVLayout.coarse_steps

    def allocate(self, keys: mx.array, values: mx.array) -> None:
        """The arrays for `capacity` positions of keys and values shaped like these."""
        B, heads, n, k_dim = keys.shape
        prefix = (B, heads, kv_allocated_tokens(max(self.capacity, n), self.coarse))
        self.keys = _quantised_zeros(prefix, k_dim, keys.dtype, self.group_size, self.bits)
        self.values = _quantised_zeros(prefix, values.shape[3], values.dtype, self.group_size, self.bits)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        if self.keys is None:
            self.allocate(keys, values)
        return super().update_and_fetch(keys, values)


class DequantizedView:
    """A quantised layer as a prefill step sees it: the step's keys and
    values are quantised into the layer (that is what stays in memory), and
    attention runs on the layer dequantised, through MLX's fused attention.
    mlx-lm's attention on quantised KV is not fused: a 512-token step over a
    32k-token context holds its scores, heads x 512 x 32k values, several
    times over, more than the whole KV cache; the dequantised copy of one
    layer is a small part of it. Decoding (one token a step) keeps mlx-lm's
    quantised attention, whose scores are one row."""

    def __init__(self, layer: QuantizedKVCache) -> None:
        self.layer = layer

    @property
    def offset(self) -> int:
        return self.layer.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        layer = self.layer
        q_keys, q_values = layer.update_and_fetch(keys, values)
        return (mx.dequantize(*q_keys, group_size=layer.group_size, bits=layer.bits),
                mx.dequantize(*q_values, group_size=layer.group_size, bits=layer.bits))

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer.make_mask(*args, **kwargs)


def prefill_views(kv: list[Any]) -> list[Any]:
    """The cache as a prefill step passes it to the model (DequantizedView);
    a decode step too where MLX cannot decode over quantised KV."""
    return [DequantizedView(c) if isinstance(c, QuantizedKVCache) else c for c in kv]


def quantized_decode_works(model: Any, layout: KVLayout) -> bool:
    """Whether this MLX backend runs mlx-lm's attention over quantised KV for
    a decode step of this model's shape. MLX 0.32's CUDA backend has no
    quantized_matmul kernel for it (batched over heads: a RuntimeError
    "No implementation for problem shape"), which must never reach a
    request: there the engine decodes through DequantizedView too."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    args = model.args
    heads = int(args.num_attention_heads)
    kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(args, "head_dim", None) or args.hidden_size // heads)
    # The activations' dtype is not always the first parameter's (norms may be
    # float32): try every floating dtype the model holds, and the 16-bit ones.
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    try:
        # As a cache hands them over: the first positions of a longer buffer
        # (a strided view; CUDA's kernel took a whole array, not these).
        for dtype in dtypes | {mx.bfloat16, mx.float16}:
            queries = mx.zeros((1, heads, 1, head_dim), dtype)
            buffer = mx.quantize(mx.zeros((1, kv_heads, 768, head_dim), dtype), group_size=layout.group_size,
                                 bits=layout.bits)
            for positions in (256, 521):
                keys = tuple(a[..., :positions, :] for a in buffer)
                mx.eval(quantized_scaled_dot_product_attention(queries, keys, keys, scale=1.0, mask=None,
                                                               group_size=layout.group_size, bits=layout.bits))
        return True
    except (RuntimeError, ValueError):
        return False


def make_kv(model: Any, capacity: int, layout: KVLayout) -> list[Any]:
    """A fresh cache for a request of `capacity` positions: the model's own
    cache kinds (mlx-lm's `make_prompt_cache`), its plain KV layers
    allocated once and, per `layout`, quantised from the first position
    (later ones: `quantize_from`)."""
    out = []
    for c in make_prompt_cache(model):
        if type(c) is KVCache:
            if layout.quantized and layout.quantized_start == 0:
                c = AllocatedQuantizedKVCache(capacity, layout.group_size, layout.bits, layout.coarse_steps)
            else:
                c = AllocatedKVCache(capacity, layout.coarse_steps)
        out.append(c)
    return out


def quantize_from(kv: list[Any], layout: KVLayout) -> None:
    """Quantise, in place, the layers that have reached `quantized_start`
    positions (a prefill step's end; mlx-lm does the same between decode steps)."""
    if not layout.quantized:
        return
    for i, c in enumerate(kv):
        if isinstance(c, KVCache) and c.offset >= layout.quantized_start:
            kv[i] = c.to_quantized(group_size=layout.group_size, bits=layout.bits)


def unquantised_kinds(model: Any) -> list[str]:
    """The model's cache kinds that `kv_bits` leaves at the model's dtype."""
    return sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})


def packed_length(offset: int, room: int, step: int, coarse: bool = False) -> int:
    """The buffer a reused layer is copied into: its tokens and the turn's
    new ones (its prompt's rest and max_tokens), rounded up to mlx-lm's
    growth step, or allocated as a fresh request's is (`coarse`:
    KVLayout.coarse_steps). A cache mlx-lm grows from a fresh start always
    has such a buffer; one continued from an odd offset does not
    (KVCache.update_and_fetch cuts it back there before growing), and
    decoding on such a buffer is slower on MLX CUDA (docs/BENCHMARKS.md,
    "Why the engine is built as it is")."""
    if coarse:
        return kv_allocated_tokens(offset + room, coarse=True)
    return -(-(offset + room) // step) * step


def needs_repack(buffer_len: int, offset: int, room: int, step: int, shared: bool, coarse: bool = False) -> bool:
    """Whether a layer's buffer must be copied before the turn: always when
    it is shared with an entry that stays (mlx-lm writes new tokens into the
    buffer in place), else unless it is already a length a fresh buffer
    takes (whole steps; `coarse`, a coarse step's) with room for the new tokens."""
    whole = kv_allocated_tokens(buffer_len, coarse=True) == buffer_len if coarse else buffer_len % step == 0
    return shared or not whole or buffer_len < offset + room


def _buffer_len(c: Any) -> int:
    return c.keys[0].shape[2] if isinstance(c, QuantizedKVCache) else c.keys.shape[2]


def packed(kv: list[Any], room: int, shared: bool = False, coarse: bool = False) -> list[Any]:
    """The cache with each plain or quantised KV layer in a buffer of
    packed_length, copied where needs_repack says so: the turn's KV, allocated
    once at the length admission granted (`coarse`: KVLayout.coarse_steps)."""
    out, fresh = [], []
    for c in kv:
        if isinstance(c, (KVCache, QuantizedKVCache)) and c.keys is not None \
                and needs_repack(_buffer_len(c), c.offset, room, c.step, shared, coarse):
            n, length = c.offset, packed_length(c.offset, room, c.step, coarse)
            if isinstance(c, QuantizedKVCache):
                new = AllocatedQuantizedKVCache(length, c.group_size, c.bits, coarse)
                new.keys = tuple(mx.zeros((*a.shape[:2], length, a.shape[3]), a.dtype) for a in c.keys)
                new.values = tuple(mx.zeros((*a.shape[:2], length, a.shape[3]), a.dtype) for a in c.values)
                pairs = list(zip(new.keys + new.values, c.keys + c.values))
            else:
                new = AllocatedKVCache(length, coarse)
                new.keys = mx.zeros((*c.keys.shape[:2], length, c.keys.shape[3]), c.keys.dtype)
                new.values = mx.zeros((*c.values.shape[:2], length, c.values.shape[3]), c.values.dtype)
                pairs = [(new.keys, c.keys), (new.values, c.values)]
            for target, source in pairs:
                target[..., :n, :] = source[..., :n, :]
                fresh.append(target)
            new.offset = n
            c = new
        out.append(c)
    mx.async_eval(fresh)  # queued, not waited for: the batch's next step need not wait for the copy (nor it for the step)
    return out


def fitted_bytes(kv: list[Any]) -> int:
    """Bytes `fitted(kv)` takes: every KV layer cut to the positions it holds."""
    total = 0
    for c in kv:
        if isinstance(c, (KVCache, QuantizedKVCache)) and c.keys is not None and c.offset < _buffer_len(c):
            total += c.nbytes * c.offset // _buffer_len(c)
        else:
            total += int(c.nbytes)
    return total


def fitted(kv: list[Any], copy_others: bool = False) -> list[Any]:
    """The cache with every KV layer copied into arrays of just the positions
    it holds (mlx-lm's own classes): what the prompt cache keeps of a turn,
    not the room its request was allocated. Other layers as they are, or
    deep copies (`copy_others`: a snapshot the turn goes on writing past)."""
    import copy

    out, fresh = [], []
    for c in kv:
        if isinstance(c, (KVCache, QuantizedKVCache)) and c.keys is not None:
            n = c.offset
            if isinstance(c, QuantizedKVCache):
                keys = tuple(mx.contiguous(a[..., :n, :]) for a in c.keys)
                values = tuple(mx.contiguous(a[..., :n, :]) for a in c.values)
                c = QuantizedKVCache.from_state((keys, values, n, c.group_size, c.bits))
                fresh += [*keys, *values]
            else:
                keys, values = mx.contiguous(c.keys[..., :n, :]), mx.contiguous(c.values[..., :n, :])
                c = KVCache.from_state((keys, values, n))
                fresh += [keys, values]
        elif copy_others:
            c = copy.deepcopy(c)
        out.append(c)
    mx.async_eval(fresh)  # queued, not waited for (the source's arrays go once the copy has run)
    return out


def copy_prefix(target: list[Any], source: list[Any], n: int) -> bool:
    """`target`'s KV extended to position `n` with `source`'s (a device copy,
    queued): another row's prompt that starts as this one does, computed
    once. Only where every layer of both is a plain KVCache (quantised, rotating
    and recurrent layers hold what they cannot hand over by position) and
    `target` holds less than `n`. Whether it copied."""
    if not all(type(c) in (KVCache, AllocatedKVCache) for c in (*target, *source)):  # (not a subclass's window)
        return False
    if len(target) != len(source) or any(s.keys is None or s.offset < n for s in source):
        return False
    held = target[0].offset
    if held >= n or any(t.offset != held for t in target):
        return False
    for t, s in zip(target, source):
        t.update_and_fetch(s.keys[..., held:n, :], s.values[..., held:n, :])
    mx.async_eval([a for t in target for a in (t.keys, t.values)])
    return True
