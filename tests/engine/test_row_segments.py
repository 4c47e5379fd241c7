"""A step of decoding rows and joining prompts' chunks in one forward
(engine/model/row_segments.py), in process: RoPE split by segment equals
MLX's over each segment, the rows decode what each decodes alone while
others' prompts are prefilled in their steps, and the load's check says
which models may mix."""

from __future__ import annotations

import pytest

from tiny_models import tiny

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.cache import KVCache, RotatingKVCache, trim_prompt_cache  # noqa: E402

from mlxd.engine.cache.kv_cache import make_kv  # noqa: E402
from mlxd.engine.model.batch_decoder import widened  # noqa: E402
from mlxd.engine.model.prefill_pace import aligned_chunk  # noqa: E402
from mlxd.engine.model.row_attention import route_attention, segments_exact  # noqa: E402
from mlxd.engine.model.row_batch import RowBatch  # noqa: E402
from mlxd.engine.model.row_segments import (SegmentOffsets, forward_step, mixable, rope_by_segments,  # noqa: E402
                                            route_rope)
from mlxd.memory_estimate import KVLayout  # noqa: E402

ANSWER = 20


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    route_attention()  # as the runner does at load
    route_rope()
    return tiny(request.param)


@pytest.mark.parametrize("offsets, lengths, bounds, singles", [
    ((5,), (1,), [(0, 1)], 1),
    ((5, 9, 0), (1, 1, 7), [(0, 1), (1, 2), (2, 9)], 2),
    ((3, 40), (4, 2), [(0, 4), (4, 6)], 0),
    ((1, 2, 3), (1, 1, 1), [(0, 1), (1, 2), (2, 3)], 3),
])
def test_segment_offsets(offsets, lengths, bounds, singles):
    s = SegmentOffsets(offsets, lengths)
    assert s.bounds() == bounds and s.singles == singles


@pytest.mark.parametrize("offsets, lengths", [
    ((5, 9, 0), (1, 1, 7)),   # two decoding rows and a chunk from the start
    ((30,), (6,)),            # a chunk alone, past its start
    ((2, 11, 4, 60), (1, 1, 3, 5)),
    ((7, 8), (1, 1)),         # decoding rows only
])
@pytest.mark.parametrize("traditional", [False, True])
def test_rope_by_segments_rotates_each_segment_from_its_own_position(offsets, lengths, traditional):
    mx.random.seed(3)
    x = mx.random.normal((1, 4, sum(lengths), 16))
    kwargs = dict(traditional=traditional, base=10000.0, scale=1.0)
    got = rope_by_segments(x, 16, offset=SegmentOffsets(offsets, lengths), **kwargs)
    parts, start = [], 0
    for first, n in zip(offsets, lengths):
        parts.append(mx.fast.rope(x[:, :, start:start + n], 16, offset=first, **kwargs))
        start += n
    assert mx.allclose(got, mx.concatenate(parts, axis=2), atol=1e-5)
    plain = rope_by_segments(x, 16, offset=3, **kwargs)  # any other offset: MLX's own
    assert mx.allclose(plain, mx.fast.rope(x, 16, offset=3, **kwargs))


def _prefilled(model, tokens: list[int], room: int) -> list:
    kv = make_kv(model, len(tokens) + room, KVLayout())
    if tokens:
        model(mx.array([tokens]), cache=kv)
    return kv


def _alone(model, prompt: list[int]) -> list[int]:
    kv = _prefilled(model, prompt[:-1], ANSWER + 8)
    token, out = prompt[-1], []
    for _ in range(ANSWER):
        token = int(model(mx.array([[token]]), cache=kv)[0, -1].argmax())
        out.append(token)
    return out


@pytest.mark.parametrize("chunk, align", [(1, None), (4, None), (16, None), (4, 8), (16, 8), (16, 256)])
def test_rows_decode_while_joining_prompts_are_prefilled_in_their_steps(model, chunk, align):
    """Two rows decode; two more prompts (one from a cached start) are
    prefilled `chunk` tokens a step in the same forwards, join, and every
    row's answer is the one it decodes alone. With `align` (MLX's CUDA
    backend), each chunk is widened to whole steps of it as the batch
    decoder does (batch_decoder.widened: cached tokens run again, padding
    after), and the padding cut from the cache after the step."""
    prompts = [[(3 * j + i) % 101 for j in range(n)] for i, n in enumerate((6, 19, 33, 12))]
    alone = [_alone(model, p) for p in prompts]
    batch = RowBatch(model, frozenset())
    out: dict[int, list[int]] = {}
    for p in prompts[:2]:
        out[batch.insert(p[-1], _prefilled(model, p[:-1], ANSWER + 8), ANSWER, p[:-1], None, [])] = []
    joining = [(prompts[2], _prefilled(model, [], len(prompts[2]) + ANSWER + 8), 0),
               (prompts[3], _prefilled(model, prompts[3][:4], len(prompts[3]) + ANSWER + 8), 4)]
    order: dict[int, int] = {0: 0, 1: 1}
    mixed_steps = widened_runs = 0
    while batch.rows or joining:
        chunks, still, paddings = [], [], []
        for prompt, kv, done in joining:
            part = prompt[done:min(done + chunk, len(prompt) - 1)]
            run, padding = widened(kv, prompt[:done], part, align) if align else (part, 0)
            widened_runs += len(run) > len(part)
            chunks.append((kv, run))
            paddings.append((kv, padding))
            still.append((prompt, kv, done + len(part)))
        mixed_steps += bool(chunks and batch.rows)
        for t in batch.next(chunks):
            out[t.uid].append(t.token)
        for kv, padding in paddings:
            trim_prompt_cache(kv, padding)
        joining = []
        for prompt, kv, done in still:
            if done == len(prompt) - 1:  # only its last token left: it joins
                uid = batch.insert(prompt[-1], kv, ANSWER, prompt[:-1], None, [])
                out[uid], order[uid] = [], prompts.index(prompt)
            else:
                joining.append((prompt, kv, done))
    assert mixed_steps >= 2 and (widened_runs >= 1 if align else True)
    assert [out[u] for u in sorted(out, key=order.get)] == alone


@pytest.mark.parametrize("offset, n, buffer_len, align, want", [
    (0, 2048, 16384, 256, (0, 2048)),          # a fresh prompt's chunk of whole steps: as it is
    (15626, 1900, 18432, 256, (15616, 17664)),  # a turn over a cached start: 10 cached tokens again, 138 padding
    (15626, 1900, 17600, 256, (15626, 17526)),  # the buffer does not hold the padded end: as it is
    (5, 3, 64, 8, (0, 8)),
    (8, 8, 16, 8, (8, 16)),                    # whole steps already
    (7, 0, 64, 8, (7, 7)),                     # nothing to run
])
def test_aligned_chunk(offset, n, buffer_len, align, want):
    assert aligned_chunk(offset, n, buffer_len, align) == want


def test_a_step_computes_the_decoding_rows_logits_only(model):
    """The step's logits are the decoding rows' ([rows, vocab]), equal to
    what each row gets alone; the chunk's go to its cache only."""
    kvs = [_prefilled(model, p, 16) for p in ([1, 2, 3], [4, 5, 6, 7, 8])]
    alone = [_prefilled(model, p, 16) for p in ([1, 2, 3], [4, 5, 6, 7, 8])]
    chunk_kv, chunk_alone = _prefilled(model, [9], 16), _prefilled(model, [9], 16)
    logits = forward_step(model, [*kvs, chunk_kv], mx.array([11, 12, 20, 21, 22], dtype=mx.int32), [1, 1, 3], 2)
    assert logits.shape == (2, 101)
    each = mx.concatenate([model(mx.array([[t]]), cache=kv)[:, -1] for t, kv in zip((11, 12), alone)])
    assert mx.allclose(logits, each, atol=1e-4)
    model(mx.array([[20, 21, 22]]), cache=chunk_alone)
    assert all(mx.allclose(a, b, atol=1e-5) for m, o in zip(chunk_kv, chunk_alone) for a, b in zip(m.state[:2], o.state[:2]))


def test_which_models_mix(model):
    """The load's check: plain KV caches mix; a rotating window does not (a
    chunk's window mask is its own cache's); a model that computes positions
    from its cache's offset itself fails the check instead of mixing wrongly."""
    assert segments_exact(model)
    assert mixable([[KVCache(), KVCache()]]) and not mixable([[KVCache(), RotatingKVCache(max_size=8)]])

    class OwnPositions:  # a model reading the offset as a number (a position embedding of its own)
        def __init__(self, inner):
            self.inner, self.layers = inner, inner.layers

        def __call__(self, inputs, cache=None):
            return self.inner(inputs, cache=cache) + mx.array(cache[0].offset + 1.0) * 0

        def parameters(self):
            return self.inner.parameters()

        def __contains__(self, key):
            return False

        def get(self, key):
            return None

    assert not segments_exact(OwnPositions(model))
