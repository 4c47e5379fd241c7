"""The batch's decode loop (engine/model/row_batch.py), in process: rows of
different lengths, each over its own cache, decode the tokens each decodes
alone -- quantised KV included (kv_bits), from the first position or from a
start some rows cross while they decode together."""

from __future__ import annotations

import pytest

from tiny_models import tiny

mx = pytest.importorskip("mlx.core")

from mlxd.engine.cache.kv_cache import make_kv, prefill_views, quantize_from  # noqa: E402
from mlxd.engine.model.row_attention import route_attention  # noqa: E402
from mlxd.engine.model.row_batch import RowBatch  # noqa: E402
from mlxd.memory_estimate import KVLayout  # noqa: E402

PROMPTS = [[(3 * j + i) % 101 for j in range(n)] for i, n in enumerate((5, 17, 40))]
ANSWER = 24


@pytest.fixture(scope="module")
def model():
    route_attention()  # as the runner does at load: RowsLayer attention row by row
    return tiny("llama")


def _prefilled(model, prompt: list[int], layout: KVLayout) -> list:
    kv = make_kv(model, len(prompt) + ANSWER + 8, layout)
    model(mx.array([prompt[:-1]]), cache=prefill_views(kv))
    quantize_from(kv, layout)
    return kv


def _alone(model, prompt: list[int], layout: KVLayout, dequantized: bool) -> list[int]:
    """Greedy tokens of one row by itself, a token a forward."""
    kv = _prefilled(model, prompt, layout)
    token, out = prompt[-1], []
    for _ in range(ANSWER):
        logits = model(mx.array([[token]]), cache=prefill_views(kv) if dequantized else kv)
        quantize_from(kv, layout)
        token = int(logits[0, -1].argmax())
        out.append(token)
    return out


def _together(model, layout: KVLayout, dequantized: bool) -> tuple[dict[int, list[int]], list]:
    batch = RowBatch(model, frozenset(), kv_layout=layout, dequantized=dequantized)
    kvs = [_prefilled(model, p, layout) for p in PROMPTS]
    uids = [batch.insert(p[-1], kv, ANSWER, p[:-1], None, []) for p, kv in zip(PROMPTS, kvs)]
    out: dict[int, list[int]] = {u: [] for u in uids}
    for _ in range(ANSWER + 2):
        for t in batch.next():
            out[t.uid].append(t.token)
    return out, kvs


@pytest.mark.parametrize("layout, dequantized", [
    (KVLayout(), False),
    (KVLayout(8, 32, 0), False),     # quantised from the first position: mlx-lm's quantised attention per row
    (KVLayout(4, 32, 0), False),
    (KVLayout(8, 32, 30), False),    # the rows cross the start at different steps, while decoding together
    (KVLayout(8, 32, 0), True),      # a backend without quantised attention reads each layer dequantised
], ids=["16-bit", "8-bit", "4-bit", "8-bit-from-30", "8-bit-dequantized"])
def test_rows_decode_together_what_each_decodes_alone(model, layout, dequantized):
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out, kvs = _together(model, layout, dequantized)
    assert list(out.values()) == [_alone(model, p, layout, dequantized) for p in PROMPTS]
    assert all(len(tokens) == ANSWER for tokens in out.values())
    if layout.quantized:  # a row is quantised once it holds the start, however long it was when it joined
        for kv in kvs:
            held = kv[0].offset
            assert all(isinstance(c, QuantizedKVCache) == (held >= layout.quantized_start) for c in kv), held
        assert any(isinstance(c, QuantizedKVCache) and c.bits == layout.bits for kv in kvs for c in kv)
    else:
        assert all(isinstance(c, KVCache) for kv in kvs for c in kv)


@pytest.mark.parametrize("tokens, others, expected", [
    ([1, 2, 3, 4], [], (-1, 0)),
    ([1, 2, 3, 4], [[9, 2, 3]], (-1, 0)),
    ([1, 2, 3, 4], [[1, 2, 9], [1, 2, 3, 9]], (1, 3)),
    ([1, 2, 3, 4], [[1, 2, 3, 4, 5, 6]], (0, 4)),       # another's longer prompt: all of this one
    ([1, 2], [[1, 2, 3], [1, 2, 4]], (0, 2)),            # a tie: the first
])
def test_shared_start(tokens, others, expected):
    from mlxd.engine.model.batch_decoder import shared_start

    assert shared_start(tokens, others) == expected


@pytest.mark.parametrize("layout, copies", [(KVLayout(), True), (KVLayout(8, 32, 0), False)])
def test_a_prefix_copied_from_another_row_decodes_as_one_prefilled(model, layout, copies):
    """engine/cache/kv_cache.py's copy_prefix: a row's KV extended with
    another's for the prompt they share, then its own part prefilled, gives
    the tokens of the row prefilled whole; quantised layers are not copied."""
    from mlxd.engine.cache.kv_cache import copy_prefix

    shared = PROMPTS[2][:30]
    mine = shared + [7, 8, 9, 10]
    source = _prefilled(model, shared + [50, 51, 52], layout)
    kv = make_kv(model, len(mine) + ANSWER + 8, layout)
    assert copy_prefix(kv, source, len(shared)) is copies
    if not copies:
        return
    assert kv[0].offset == len(shared)
    model(mx.array([mine[len(shared):-1]]), cache=kv)
    batch = RowBatch(model, frozenset())
    uid = batch.insert(mine[-1], kv, ANSWER, mine[:-1], None, [])
    out = [t.token for _ in range(ANSWER + 1) for t in batch.next() if t.uid == uid]
    assert out == _alone(model, mine, layout, False)


def test_the_batch_probe_times_a_batched_step_against_one_row(model):
    """engine/model/batch_probe.py: a ratio of tokens a second, from real
    steps, that leaves every row's cache as it found it (none: it makes its own)."""
    from mlxd.engine.model.batch_probe import batch_speedup

    for width in (1, 5):  # a plain step's shape, a verify's
        ratio = batch_speedup(model, rows=3, context=32, repeats=3, width=width)
        assert 0 < ratio < 30


@pytest.mark.parametrize("layout, dequantized", [
    (KVLayout(8, 32, 0), False),
    (KVLayout(8, 32, 80), False),    # the rows cross the start while proposing: no verify runs a row past it
    (KVLayout(8, 32, 0), True),
], ids=["8-bit", "8-bit-from-80", "8-bit-dequantized"])
def test_prompt_lookup_over_quantised_kv_decodes_what_plain_steps_do(model, layout, dequantized):
    """kv_bits with prompt lookup: rows whose prompts repeat (proposals
    accepted) decode, together, the tokens each decodes alone a token a
    forward over the same quantised layout."""
    from mlxd.engine.model.row_proposals import LookupProposer

    prompts = []
    for i in range(2):
        base = [(5 * j + 3 + i) % 97 for j in range(20 + 6 * i)]
        prompts.append(base + _alone(model, base, layout, dequantized) + base)
    batch = RowBatch(model, frozenset(), verify_together=True, kv_layout=layout, dequantized=dequantized)
    proposers = [LookupProposer(list(p)) for p in prompts]
    uids = [batch.insert(p[-1], _prefilled(model, p, layout), ANSWER, p[:-1], None, [], proposer=q)
            for p, q in zip(prompts, proposers)]
    for r in batch.rows:  # a row short of the start proposes no more than fits before it
        held = r.kv[0].offset
        if layout.quantized_start > held:
            assert batch._room(r) <= layout.quantized_start - held - 1
    out = {u: [] for u in uids}
    while batch.rows:
        for t in batch.next():
            out[t.uid].append(t.token)
    assert [out[u] for u in uids] == [_alone(model, p, layout, dequantized) for p in prompts]
    assert sum(q.stats.accepted for q in proposers) > 0  # verify steps ran and kept proposals
