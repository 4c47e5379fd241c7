"""mlx-lm's batch's KV allocated when rows join, at the length they were
admitted to (bench/mlx_lm_batch_kv.py, what mlxd ran before its own batch, kept
for the benchmarks that compare with mlx-lm's BatchGenerator): its bookkeeping as tables (pure), and
mlx-lm's BatchGenerator on a small model decoding the same tokens with it as
with mlx-lm's own growing cache, its array reallocated only when rows join."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from testkit import load_bench

_kv = load_bench("mlx_lm_batch_kv")
AllocatedBatchKVCache, batch_capacity, rows_for_batch, spend = (_kv.AllocatedBatchKVCache, _kv.batch_capacity,
                                                             _kv.rows_for_batch, _kv.spend)


@pytest.mark.parametrize("prompt_left, answer_left, n, expected", [
    ([100, 0], [50, 20], 1, ([99, 0], [50, 19])),  # one row prefilling, one decoding
    ([10, 300], [5, 5], 256, ([0, 44], [5, 5])),  # a shorter chunk's padding is not its answer
    ([0, 0], [1, 0], 1, ([0, 0], [0, 0])),  # nothing goes below zero
    ([], [], 1, ([], [])),
])
def test_rows_spend_prompt_first_then_answer(prompt_left, answer_left, n, expected):
    assert spend(prompt_left, answer_left, n) == expected


@pytest.mark.parametrize("idx, prompt_left, answer_left, expected", [
    (0, [300], [100], 512),
    (100, [0, 0], [156, 10], 256),  # whole steps of 256
    (100, [0, 0], [157, 10], 512),
    (1000, [24, 0], [0, 200], 1280),  # the most to prefill plus the most to generate
    (0, [], [], 0),
])
def test_the_batch_array_holds_every_row_grant(idx, prompt_left, answer_left, expected):
    assert batch_capacity(idx, prompt_left, answer_left) == expected


def tiny_model():
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                           tie_word_embeddings=True)
    mx.random.seed(11)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


PROMPTS = [[(7 * i + j) % 97 for j in range(n)] for i, n in enumerate((40, 300, 9))]
MAX_TOKENS = [300, 20, 120]


def run_batch(model, allocated: bool, join_late: bool):
    """Greedy tokens per request, and the batch cache's first layer's array
    lengths seen at each step."""
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=4, prefill_batch_size=4, prefill_step_size=64)
    tokens: dict[int, list[int]] = {}
    lengths = []

    def insert(i):
        kv = make_prompt_cache(model)
        if allocated:
            kv = rows_for_batch(kv, len(PROMPTS[i]), MAX_TOKENS[i])
        (uid,) = gen.insert_segments([[PROMPTS[i]]], max_tokens=[MAX_TOKENS[i]], caches=[kv])
        tokens[uid] = []

    for i in range(len(PROMPTS) if not join_late else 1):
        insert(i)
    steps = 0
    while True:
        _, responses = gen.next()
        steps += 1
        if join_late and steps in (30, 60):
            insert(1 if steps == 30 else 2)
        for r in responses:
            tokens[r.uid].append(r.token)
        cache = gen._generation_batch.prompt_cache
        if cache:
            lengths.append((type(cache[0]).__name__, cache[0].keys.shape[2], len(gen._generation_batch)))
        if all(len(t) == m for t, m in zip(tokens.values(), MAX_TOKENS)) and len(tokens) == len(PROMPTS):
            break
        assert steps < 2000
    gen.close()
    return [tokens[uid] for uid in sorted(tokens)], lengths


@pytest.mark.parametrize("join_late", [False, True])
def test_the_batch_decodes_the_same_tokens_into_an_array_allocated_at_joins(join_late):
    model = tiny_model()
    grown, grown_lengths = run_batch(model, allocated=False, join_late=join_late)
    allocated, lengths = run_batch(model, allocated=True, join_late=join_late)
    assert allocated == grown
    assert {kind for kind, _, _ in lengths} == {AllocatedBatchKVCache.__name__}
    # The array's length changes only where the batch's rows change (a join or a leave).
    for (_, before, rows_before), (_, after, rows_after) in zip(lengths, lengths[1:]):
        if rows_before == rows_after:
            assert after == before
    # mlx-lm's own cache grew while the batch decoded.
    assert any(b != a and rb == ra for (_, b, rb), (_, a, ra) in zip(grown_lengths, grown_lengths[1:]))

