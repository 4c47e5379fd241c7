"""Cascade attention over a shared prefix (engine/model/cascade_attention.py):
exact against attention over each row's concatenated keys, over a table of
shapes; and a tiny model's rows over one prefix, prefilled alone and decoded
together (RowsLayer), give the logits each row gets over a plain KVCache."""

from __future__ import annotations

import itertools

import pytest

from tiny_models import tiny

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache  # noqa: E402

from mlxd.engine.model.cascade_attention import (SharedPrefix, SharedPrefixKVCache, attend_shared,  # noqa: E402
                                                 cascade_attention, over_same_prefix, shared_prefix_kv)
from mlxd.engine.model import cascade_attention as cascade_attention_module  # noqa: E402
from mlxd.engine.model.row_attention import positions, route_attention, row_caches  # noqa: E402

# Each row's own tokens: unequal, with rows of none and of one ("short"), or every row at least a
# verify's queries ("long": where the fused way's "causal" applies).
SUFFIXES = {"short": (0, 17, 1, 6), "long": (3, 40, 5, 9)}
# Worst |cascade - fused| over outputs of magnitude ~1: float32 exact to rounding; the half
# precisions' scores and probabilities are rounded in both (at different steps).
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}

SHAPES = list(itertools.product(
    (1, 2, 3, 4),                        # rows
    (1, 3),                              # queries a row: decode, a verify step
    (0, 1, 100),                         # shared prefix
    tuple(SUFFIXES),                     # the rows' own lengths
    (1, 4),                              # query heads per KV head
    (64, 128),                           # head_dim
    ("float32", "bfloat16", "float16"),
    ("explicit", "fused"),               # how each part is computed (cascade_attention's `way`)
))


def _case(B, L, P, ratio, D, dtype, seed=0, kv_heads=2, own="short"):
    mx.random.seed(seed)
    dt = getattr(mx, dtype)
    lengths = [max(s, L - P) for s in SUFFIXES[own][:B]]  # every query sees a key (P = 0: its own)
    queries = mx.random.normal((B, kv_heads * ratio, L, D)).astype(dt)
    prefix = [mx.random.normal((1, kv_heads, P, D)).astype(dt) for _ in range(2)]
    suffixes = [tuple(mx.random.normal((1, kv_heads, s, D)).astype(dt) for _ in range(2)) if s else None
                for s in lengths]
    return queries, prefix, suffixes


def _reference(queries, prefix, suffixes, scale, sinks=None):
    """MLX's fused attention over each row's [prefix | suffix], as a row's own KVCache holds it."""
    rows = []
    for b, suffix in enumerate(suffixes):
        k = prefix[0] if suffix is None else mx.concatenate([prefix[0], suffix[0]], axis=2)
        v = prefix[1] if suffix is None else mx.concatenate([prefix[1], suffix[1]], axis=2)
        mask = "causal" if queries.shape[2] > 1 else None
        rows.append(mx.fast.scaled_dot_product_attention(queries[b:b + 1], k, v, scale=scale, mask=mask,
                                                         sinks=sinks))
    return mx.concatenate(rows, axis=0)


@pytest.mark.parametrize("B, L, P, own, ratio, D, dtype, way", SHAPES,
                         ids=[f"B{b}-q{l}-P{p}-{o}-gqa{r}-D{d}-{t}-{w}" for b, l, p, o, r, d, t, w in SHAPES])
def test_cascade_is_attention_over_the_concatenation(B, L, P, own, ratio, D, dtype, way):
    queries, prefix, suffixes = _case(B, L, P, ratio, D, dtype, own=own)
    scale = D ** -0.5
    out = cascade_attention(queries, prefix[0], prefix[1], suffixes, scale, way=way)
    assert out.shape == queries.shape and out.dtype == queries.dtype
    ref = _reference(queries, prefix, suffixes, scale)
    worst = float(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max())
    assert worst <= TOLERANCE[dtype], worst


@pytest.mark.parametrize("way", ["explicit", "fused"])
@pytest.mark.parametrize("L, P", [(1, 100), (3, 100), (3, 1), (1, 0)])
def test_sinks_are_a_term_of_zero_value(L, P, way):
    """gpt-oss's attention sinks: a logit per head in every softmax, as MLX's fused kernel takes them."""
    queries, prefix, suffixes = _case(3, L, P, 4, 64, "float32", seed=3)
    sinks = mx.random.normal((queries.shape[1],)) * 2
    out = cascade_attention(queries, prefix[0], prefix[1], suffixes, 0.125, sinks=sinks, way=way)
    ref = _reference(queries, prefix, suffixes, 0.125, sinks=sinks)
    assert float(mx.abs(out - ref).max()) <= 2e-5


def test_a_query_that_would_see_nothing_is_refused():
    queries, prefix, _ = _case(2, 3, 1, 1, 64, "float32")
    with pytest.raises(ValueError, match="see none"):
        cascade_attention(queries, prefix[0], prefix[1], [None, None], 0.125)


def _layer(P=10, S=4, D=8):
    mx.random.seed(5)
    prefix = SharedPrefix(mx.random.normal((1, 2, P, D)), mx.random.normal((1, 2, P, D)))
    c = SharedPrefixKVCache(prefix)
    c.update_and_fetch(mx.random.normal((1, 2, S, D)), mx.random.normal((1, 2, S, D)))
    return c


def test_the_cache_holds_a_reference_and_trims_its_own_part_only():
    c = _layer()
    other = SharedPrefixKVCache(c.prefix)
    assert other.prefix is c.prefix and c.prefix.keys is other.prefix.keys  # the prefix, never copied
    assert (c.offset, other.offset, c.size()) == (14, 10, 14)
    assert c.nbytes == c.suffix.nbytes and other.nbytes == 0  # the prefix is counted once, by its holder
    assert c.is_trimmable() and c.trim(100) == 4 and c.offset == 10 and c.own() is None
    assert c.make_mask(1) is None and c.make_mask(3) == "causal"
    assert c.make_mask(3, return_array=True).shape == (3, 13)


def test_update_and_fetch_gives_the_whole_keys_and_state_round_trips():
    """A model that reads the keys itself gets [prefix | suffix]; state rebuilds the row."""
    c = _layer()
    keys, values = c.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    plain = c.to_kv()
    assert keys.shape[2] == 15 and plain.offset == 15
    assert mx.array_equal(keys, plain.keys) and mx.array_equal(values, plain.values)
    again = SharedPrefixKVCache.from_state(c.state)
    assert again.offset == 15 and mx.array_equal(again.to_kv().keys, keys)
    with pytest.raises(ValueError):
        SharedPrefixKVCache(c.prefix, suffix=KVCache().to_quantized())


def test_rows_group_by_prefix_object():
    """Two prefixes and a plain row in one step: each prefix's rows in one call, the plain row left apart."""
    a, b = _layer(P=10, S=3), _layer(P=6, S=2)
    rows = [a, b, SharedPrefixKVCache(a.prefix, KVCache()), KVCache()]
    rows[2].update_and_fetch(mx.ones((1, 2, 2, 8)), mx.ones((1, 2, 2, 8)))
    queries = mx.random.normal((4, 4, 1, 8))
    out = attend_shared(queries, rows, 0.3, None)
    assert out[3] is None
    for i in range(3):
        whole = rows[i].to_kv()
        ref = mx.fast.scaled_dot_product_attention(queries[i:i + 1], whole.keys, whole.values, scale=0.3)
        assert float(mx.abs(out[i] - ref).max()) <= 2e-5


# --- a tiny model: rows over one prefix, as each alone over a plain KVCache ------------------------

PREFIX = [(7 * j + 3) % 101 for j in range(40)]
OWN = [[(5 * j + 1) % 101 for j in range(6)], [(11 * j + 2) % 101 for j in range(25)]]  # cascade; fused


@pytest.fixture(scope="module")
def model():
    route_attention()  # as the runner does at load
    return tiny("llama")  # 4 query heads, 2 KV heads


def _close(a, b, tol=1e-4):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.abs(a - b).max()) <= tol * (float(mx.abs(b).max()) + 1e-6)


@pytest.mark.parametrize("way", ["explicit", "fused"])
def test_rows_over_a_shared_prefix_give_the_logits_each_gets_alone(model, way, monkeypatch):
    monkeypatch.setattr(cascade_attention_module, "WAY", way)
    base = make_prompt_cache(model)
    model(mx.array([PREFIX]), cache=base)  # the prefix prefilled once
    first = shared_prefix_kv(base)
    rows = [first, over_same_prefix(first)]
    plain = [make_prompt_cache(model) for _ in OWN]
    for suffix, row, alone in zip(OWN, rows, plain):
        got = model(mx.array([suffix]), cache=row)  # a row prefilled alone: its own part only
        want = model(mx.array([PREFIX + suffix]), cache=alone)[:, len(PREFIX):]
        assert _close(got, want)
    assert all(a.prefix is b.prefix for a, b in zip(*rows))
    assert [c.offset for c in rows[1]] == [len(PREFIX) + len(OWN[1])] * len(rows[1])

    # Decode steps together (RowsLayer: one cascade call over both rows), beside a row over a plain cache.
    third = make_prompt_cache(model)
    model(mx.array([[9, 8, 7, 6, 5]]), cache=third)
    steps = [[[11], [12], [13]], [[14], [15], [16]]]
    for tokens in steps:
        kv = [*rows, third]
        together = model(mx.array(tokens), cache=row_caches(kv, positions(kv)))
        each = [model(mx.array([t]), cache=c) for t, c in zip(tokens[:2], plain)]
        assert _close(together[:2], mx.concatenate(each, axis=0))

    # A verify step of three tokens a row (causal over each row's own suffix), then cut back, then one more.
    verify = [[20, 21, 22], [23, 24, 25], [26, 27, 28]]
    kv = [*rows, third]
    together = model(mx.array(verify), cache=row_caches(kv, positions(kv)))
    each = [model(mx.array([t]), cache=c) for t, c in zip(verify[:2], plain)]
    assert _close(together[:2], mx.concatenate(each, axis=0))
    for row, alone in zip(rows, plain):
        assert trim_prompt_cache(row, 2) == 2 and trim_prompt_cache(alone, 2) == 2
    trim_prompt_cache(third, 2)
    kv = [*rows, third]
    together = model(mx.array([[30], [31], [32]]), cache=row_caches(kv, positions(kv)))
    each = [model(mx.array([t]), cache=c) for t, c in zip([[30], [31]], plain)]
    assert _close(together[:2], mx.concatenate(each, axis=0))


def test_the_fastest_way_is_one_of_the_three():
    from mlxd.engine.model.cascade_attention import fastest_way

    assert fastest_way(4, 2, 16, mx.float32, prefix=64, suffixes=(4, 9), repeats=1) in (None, "explicit", "fused")
