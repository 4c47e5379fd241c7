"""Attention of rows that share a prompt prefix: the prefix's KV held once and read once a step.

Agents that share a long system prompt decode rows whose caches begin with
the same KV. Held as each row's own copy, it is stored B times and read B
times a step (a decode step is memory-bound: reading KV is its cost). Here
such a row's cache is a `SharedPrefixKVCache`: a reference to one layer's
prefix KV (`SharedPrefix`, never copied) and its own KVCache for what
follows. A step over rows that share one prefix computes their attention in
one call (`cascade_attention`): all the rows' queries are folded into the
query-length axis (with GQA's query heads of a KV head: [1, kv_heads,
B*group*q_len, D]) and meet the prefix's keys in one matrix product (the
prefix read once for all of them); each row's own suffix is attended apart;
the two parts are merged by their log-sum-exp, which is exact: softmax over
[prefix | suffix] is the two partial softmaxes weighted by their shares of
the denominator.

MLX's fused attention does not return the log-sum-exp. The `explicit` way
computes each part's scores and softmax itself, the softmax in float32 (the
scores come out of the matrix product in the queries' dtype, as in MLX's
unfused path: casting the prefix's keys up would copy it every step). The
`fused` way takes each part's output from the fused kernel and computes only
the log-sum-exp from scores (the keys read twice, far fewer kernels).
Which is faster, and whether cascade beats each row apart, depends on the
backend: bench/cascade_attention.py measures it, `fastest_way` picks it.
A decode or verify step's scores are a few rows per head, small beside the
KV they read. A long prefill chunk would hold heads x chunk x prefix scores,
so a row prefilled alone attends over the concatenation with the fused
kernel instead (`SharedPrefixKVCache.attend`). Attention sinks (gpt-oss)
are one more log-sum-exp term, of zero value. Quantised KV is not handled
(a row whose suffix is quantised is not a SharedPrefixKVCache).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

# Set False on a backend where per-row fused attention over the whole keys
# measured faster (bench/cascade_attention.py): rows then attend apart, each
# over its [prefix | suffix] concatenation, still holding the prefix once.
CASCADE = True
# A step of more queries a row than this (a prefill chunk) attends over the
# concatenation, fused: cascade's explicit scores would be heads x queries x prefix.
MAX_CASCADE_QUERIES = 16
# How cascade computes each part (cascade_attention's `way`), the faster on this backend.
WAY = "explicit"
_NEG_INF = float("-inf")


class SharedPrefix:
    """One layer's KV of a prefix rows share: keys and values [1, kv_heads,
    P, D], read by every row that holds it, written by none. Rows over the
    same prefix hold the same object (attention groups them by identity);
    its bytes are counted once, here, not in the rows' caches."""

    def __init__(self, keys: mx.array, values: mx.array) -> None:
        if keys.ndim != 4 or keys.shape[0] != 1 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"a shared prefix is [1, kv_heads, P, D]: keys {keys.shape}, values {values.shape}")
        self.keys = keys
        self.values = values

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _scored(q: mx.array, k: mx.array, v: mx.array, visible: mx.array | None) -> tuple[mx.array, mx.array]:
    """Attention of scaled queries q [..., M, D] over k, v [..., N, D] (all
    of it, or where `visible` [M, N] says): its output, float32 and
    normalised over these keys only, and each query's log-sum-exp [..., M, 1]
    (-inf, output 0, for a query that sees none of them)."""
    scores = (q @ k.swapaxes(-1, -2)).astype(mx.float32)
    if visible is None:  # every query sees a key: no guard (fewer kernels)
        top = scores.max(axis=-1, keepdims=True)
    else:
        scores = mx.where(visible, scores, _NEG_INF)
        top = scores.max(axis=-1, keepdims=True)
        top = mx.where(top == _NEG_INF, 0.0, top)
    weights = mx.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    out = (weights.astype(v.dtype) @ v).astype(mx.float32)
    out = out / (total if visible is None else mx.maximum(total, 1e-30))
    return out, top + mx.log(total)


def _lse(q: mx.array, k: mx.array, visible: mx.array | None) -> mx.array:
    """Only the log-sum-exp of `_scored` (every query sees a key): beside MLX's fused kernel's output."""
    scores = (q @ k.swapaxes(-1, -2)).astype(mx.float32)
    if visible is not None:
        scores = mx.where(visible, scores, _NEG_INF)
    return mx.logsumexp(scores, axis=-1, keepdims=True)


def _causal(L: int, S: int, R: int) -> mx.array | None:
    """Which of S keys each of R heads' L last queries sees, [R*L, S] (None: all)."""
    if L == 1:
        return None
    causal = (mx.arange(L)[:, None] + (S - L)) >= mx.arange(S)[None, :]
    return mx.broadcast_to(causal[None], (R, L, S)).reshape(R * L, S)


def cascade_attention(queries: mx.array, prefix_keys: mx.array, prefix_values: mx.array,
                      suffixes: Sequence[tuple[mx.array, mx.array] | None], scale: float,
                      sinks: mx.array | None = None, way: str | None = None) -> mx.array:
    """softmax(q K^T * scale) V for each row over [shared prefix | its own suffix].

    queries [B, heads, L, D]; prefix keys and values [1, kv_heads, P, D]
    (P may be 0); suffixes: per row its keys and values [1, kv_heads, S_i, D]
    (None or S_i 0: none). A row's L queries are its last L positions: query
    j sees keys up to P + S_i - L + j (MLX's "causal", aligned to the end of
    its keys; L = 1 sees all of them). GQA: heads a multiple of kv_heads.
    sinks: one logit per head, a key of zero value in every softmax (gpt-oss).
    `way` (default WAY): "explicit" computes each part's softmax itself;
    "fused" takes each part's output from MLX's fused kernel and only its
    log-sum-exp from explicit scores (the keys read twice, a few kernels
    instead of a dozen; bench/cascade_attention.py measures which is faster).
    The output [B, heads, L, D] in the queries' dtype."""
    B, heads, L, D = queries.shape
    kv_heads, P = prefix_keys.shape[1], prefix_keys.shape[2]
    if len(suffixes) != B or heads % kv_heads:
        raise ValueError(f"{B} rows of {heads} heads over {len(suffixes)} suffixes of {kv_heads} KV heads")
    lengths = [0 if s is None else s[0].shape[2] for s in suffixes]
    if P + min(lengths) < L:
        raise ValueError(f"{L} queries a row over {P} + {min(lengths)} keys: a query would see none")
    # The fused kernel's "causal" is right where every row's queries sit in its own suffix.
    fused = (way or WAY) == "fused" and all(S >= L or (S == 0 and L == 1) for S in lengths)
    R = heads // kv_heads
    q = (queries * mx.array(scale, queries.dtype)).reshape(B, kv_heads, R, L, D)
    parts: list[tuple[mx.array, mx.array]] = []  # (output, lse), each [B, kv_heads, R, L, D or 1]

    if P:  # every row's queries against the prefix in one product: it is read once
        folded = q.transpose(1, 0, 2, 3, 4).reshape(1, kv_heads, B * R * L, D)
        visible = None
        if L > 1 and min(lengths) < L - 1:  # a query that sits inside the prefix sees only what precedes it
            last = mx.array(lengths)[:, None, None] + P - L + mx.arange(L)[None, None, :]  # [B, 1, L]
            last = mx.broadcast_to(last, (B, R, L)).reshape(B * R * L, 1)
            visible = mx.arange(P)[None, :] <= last
        if fused:  # rows along the query axis, heads kept: the kernel's own GQA
            rows = queries.transpose(1, 0, 2, 3).reshape(1, heads, B * L, D)
            out = mx.fast.scaled_dot_product_attention(rows, prefix_keys, prefix_values, scale=scale)
            out = out.reshape(heads, B, L, D).transpose(1, 0, 2, 3).reshape(B, kv_heads, R, L, D)
            lse = _lse(folded, prefix_keys, None)
        else:
            out, lse = _scored(folded, prefix_keys, prefix_values, visible)
            out = out.reshape(kv_heads, B, R, L, D).transpose(1, 0, 2, 3, 4)
        parts.append((out, lse.reshape(kv_heads, B, R, L, 1).transpose(1, 0, 2, 3, 4)))

    if any(lengths):  # each row's own keys apart
        outs, lses = [], []
        for b, (suffix, S) in enumerate(zip(suffixes, lengths)):
            if not S:
                outs.append(mx.zeros((kv_heads, R * L, D), mx.float32))
                lses.append(mx.full((kv_heads, R * L, 1), _NEG_INF, mx.float32))
                continue
            row_q = q[b].reshape(kv_heads, R * L, D)
            if fused:
                out = mx.fast.scaled_dot_product_attention(queries[b:b + 1], suffix[0], suffix[1], scale=scale,
                                                           mask="causal" if L > 1 else None)
                outs.append(out.reshape(kv_heads, R * L, D))
                lses.append(_lse(row_q, suffix[0][0], _causal(L, S, R)))
            else:
                out, lse = _scored(row_q, suffix[0][0], suffix[1][0], _causal(L, S, R))
                outs.append(out)
                lses.append(lse)
        parts.append((mx.stack(outs).reshape(B, kv_heads, R, L, D), mx.stack(lses).reshape(B, kv_heads, R, L, 1)))

    lse = parts[0][1]
    for _, other in parts[1:]:
        lse = mx.logaddexp(lse, other)
    if sinks is not None:
        lse = mx.logaddexp(lse, sinks.astype(mx.float32).reshape(1, kv_heads, R, 1, 1))
    out = parts[0][0] * mx.exp(parts[0][1] - lse)
    for o, part_lse in parts[1:]:
        out = out + o * mx.exp(part_lse - lse)
    return out.reshape(B, heads, L, D).astype(queries.dtype)


class SharedPrefixKVCache(_BaseCache):
    """A row's cache of one layer: [shared prefix | its own suffix]. The
    prefix is a reference (`SharedPrefix`, never copied or written); new
    tokens go to `suffix`, an mlx-lm KVCache (or mlxd's AllocatedKVCache).

    `update_and_fetch` returns the concatenation, lazily: attention routed
    through mlxd (row_attention.attention_by_rows, RowsLayer) reads the two
    parts apart and never evaluates it, so it costs nothing there; a model
    that uses the keys itself still gets the right ones, at the cost of a
    copy. Trimming cuts the suffix only; `nbytes` counts the suffix only (the
    prefix is counted once, by whoever holds the SharedPrefix)."""

    def __init__(self, prefix: SharedPrefix, suffix: KVCache | None = None) -> None:
        suffix = KVCache() if suffix is None else suffix
        if hasattr(suffix, "bits"):
            raise ValueError("a shared prefix's rows keep their own KV unquantised")
        self.prefix = prefix
        self.suffix = suffix

    @property
    def offset(self) -> int:
        return self.prefix.length + self.suffix.offset

    def own(self) -> tuple[mx.array, mx.array] | None:
        """The suffix's keys and values as far as it holds them (None: none yet)."""
        if self.suffix.keys is None or self.suffix.offset == 0:
            return None
        n = self.suffix.offset
        return self.suffix.keys[..., :n, :], self.suffix.values[..., :n, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = self.suffix.update_and_fetch(keys, values)
        if not self.prefix.length:
            return k, v
        return (mx.concatenate([self.prefix.keys, k], axis=2), mx.concatenate([self.prefix.values, v], axis=2))

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
               sinks: mx.array | None = None) -> mx.array:
        """The attention of this row alone (keys, values: what update_and_fetch
        returned): cascade for a decode or verify step, the fused kernel over
        the concatenation for a longer chunk or a mask that is an array."""
        if CASCADE and queries.shape[2] <= MAX_CASCADE_QUERIES and (mask is None or isinstance(mask, str)):
            return cascade_attention(queries, self.prefix.keys, self.prefix.values, [self.own()], scale, sinks)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self.suffix.trim(min(n, self.suffix.offset))

    @property
    def nbytes(self) -> int:
        return self.suffix.nbytes

    @property
    def state(self) -> tuple[Any, ...]:
        """The prefix's arrays and the suffix's held part: evaluating it
        evaluates what a step wrote (prefill does), never copying the prefix."""
        own = self.own()
        return (self.prefix.keys, self.prefix.values, *(own if own is not None else (None, None)))

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:  # a prefix of its own (from_state: no sharing to restore)
        keys, values, own_keys, own_values = v
        self.prefix = SharedPrefix(keys, values)
        self.suffix = KVCache() if own_keys is None else KVCache.from_state((own_keys, own_values,
                                                                            own_keys.shape[2]))

    def to_kv(self) -> KVCache:
        """A plain mlx-lm KVCache of the row's whole KV (a copy): for code that
        knows only mlx-lm's classes (saving a whole entry, a row leaving the prefix)."""
        own = self.own()
        if own is None:
            return KVCache.from_state((self.prefix.keys, self.prefix.values, self.prefix.length))
        keys = mx.concatenate([self.prefix.keys, own[0]], axis=2)
        values = mx.concatenate([self.prefix.values, own[1]], axis=2)
        return KVCache.from_state((keys, values, keys.shape[2]))


def shared_prefix_kv(prefix_kv: Sequence[Any], suffixes: Sequence[KVCache] | None = None) -> list[Any]:
    """A row's cache over a prefill's cache `prefix_kv` (mlx-lm KVCache
    layers, as `make_prompt_cache` builds them): each layer's held KV as one
    SharedPrefix. Call it once per prefix and hand every row
    `[SharedPrefixKVCache(c.prefix) for c in first]` (`over_same_prefix`)
    so that they share the objects."""
    out = []
    for i, c in enumerate(prefix_kv):
        n = c.offset
        prefix = SharedPrefix(c.keys[..., :n, :], c.values[..., :n, :])
        out.append(SharedPrefixKVCache(prefix, None if suffixes is None else suffixes[i]))
    return out


def over_same_prefix(row: Sequence[SharedPrefixKVCache], suffixes: Sequence[KVCache] | None = None) -> list[Any]:
    """Another row over the same prefix objects as `row`, with its own (fresh, or given) suffixes."""
    return [SharedPrefixKVCache(c.prefix, None if suffixes is None else suffixes[i]) for i, c in enumerate(row)]


def attend_shared(queries: mx.array, caches: Sequence[Any], scale: float,
                  sinks: mx.array | None) -> list[mx.array | None]:
    """A step's attention for the rows whose caches read a shared prefix: one
    cascade call per prefix object. Each row's output [1, heads, L, D], None
    for rows that are not over a shared prefix (they attend apart)."""
    out: list[mx.array | None] = [None] * len(caches)
    if not CASCADE:
        return out
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(caches):
        if isinstance(c, SharedPrefixKVCache):
            groups.setdefault(id(c.prefix), []).append(i)
    for rows in groups.values():
        prefix = caches[rows[0]].prefix
        q = queries if rows == list(range(queries.shape[0])) else queries[mx.array(rows)]
        got = cascade_attention(q, prefix.keys, prefix.values, [caches[i].own() for i in rows], scale, sinks)
        for j, i in enumerate(rows):
            out[i] = got[j:j + 1]
    return out


def fastest_way(heads: int, kv_heads: int, head_dim: int, dtype: Any, prefix: int = 4096,
                suffixes: Sequence[int] = (256, 512, 768, 1024), repeats: int = 5) -> str | None:
    """Which attention a decode step over rows that share a prefix is
    fastest with on this backend, timed once on random arrays of the
    model's shape: "explicit" or "fused" (cascade's ways), or None (each row
    apart over its [prefix | suffix]: set CASCADE False). For a load to set
    CASCADE and WAY by; bench/cascade_attention.py has the full table."""
    import time

    def normal(*dims: int) -> mx.array:
        return mx.random.normal(dims).astype(dtype)

    q = normal(len(suffixes), heads, 1, head_dim)
    shared = [normal(1, kv_heads, prefix, head_dim) for _ in range(2)]
    own = [(normal(1, kv_heads, s, head_dim), normal(1, kv_heads, s, head_dim)) for s in suffixes]
    mx.eval(q, shared, own)
    scale = head_dim ** -0.5
    ways: dict[str | None, Any] = {
        None: lambda: [mx.fast.scaled_dot_product_attention(
            q[i:i + 1], mx.concatenate([shared[0], k], axis=2), mx.concatenate([shared[1], v], axis=2), scale=scale)
            for i, (k, v) in enumerate(own)],
        **{way: (lambda way=way: cascade_attention(q, shared[0], shared[1], own, scale, way=way))
           for way in ("explicit", "fused")}}
    best: dict[str | None, float] = {}
    for n in range(repeats + 1):  # the first round warms up
        for way, fn in ways.items():
            began = time.perf_counter()
            mx.eval(fn())
            if n:
                best[way] = min(best.get(way, float("inf")), time.perf_counter() - began)
    return min(best, key=lambda way: best[way])
