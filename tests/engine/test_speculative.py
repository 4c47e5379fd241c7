"""Prompt-lookup decoding (engine/model/speculative.py): the n-gram index and
the draft length as tables; the generator's tokens are greedy decoding's,
token for token, on a tiny random-weight llama, in process."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.model.one_row import verify_greedy
from mlxd.engine.model.speculative import (DRAFT_MAX, PAUSE_AFTER_MISSES, PAUSE_STEPS, DraftLength, NgramIndex,
                                           SpecStats, lookup_steps)
from tiny_models import greedy, tiny_llama


@pytest.mark.parametrize("history, k, proposal", [
    ([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, [4, 5, 9]),        # the 3-token suffix occurred: what followed it
    ([1, 2, 3, 4, 5, 9, 1, 2, 3], 8, [4, 5, 9, 1, 2, 3, 4, 5]),  # past the end: the repeating text goes on
    ([7, 2, 3, 4, 8, 2, 3], 2, [4, 8]),                 # no 3-gram match: the 2-gram's
    ([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 2, [5, 1]),     # the latest occurrence wins
    ([1, 2, 3, 4, 5], 4, []),                           # nothing repeats
    ([1, 2], 4, []),                                    # too short to have a suffix that occurred before
    ([1, 2, 3, 1, 2, 3], 0, []),                        # k 0: a plain step
    ([5, 5, 5, 5], 3, [5, 5, 5]),                       # a run goes on
])
def test_the_index_proposes_what_followed_the_suffix(history, k, proposal):
    assert NgramIndex(history).propose(k) == proposal


def test_the_index_grows_with_the_answer():
    index = NgramIndex([10, 11, 12, 13, 14])
    assert index.propose(2) == []
    index.extend([10, 11])
    assert index.propose(3) == [12, 13, 14]
    index.extend([12, 99])
    assert index.propose(3) == []  # [12, 99] and [11, 12, 99] never occurred before
    index.extend([10, 11, 12])
    assert index.propose(2) == [99, 10]  # the latest [10, 11, 12] was followed by 99


@pytest.mark.parametrize("events, k_after", [
    ([], 4),
    ([(4, 4)], 8),                     # all accepted: double
    ([(4, 4), (8, 8), (8, 8)], DRAFT_MAX),  # up to the cap
    ([(4, 2)], 3),                     # a partial miss: one more than was accepted
    ([(4, 0)], 1),                     # rejected outright: one
])
def test_the_draft_length_follows_acceptance(events, k_after):
    d = DraftLength()
    for proposed, accepted in events:
        d.saw(proposed, accepted)
    assert d.next_k() == k_after


def test_misses_in_a_row_pause_proposals_and_the_pause_doubles():
    d = DraftLength()
    for _ in range(PAUSE_AFTER_MISSES):
        d.saw(1, 0)
    assert [d.next_k() for _ in range(PAUSE_STEPS)] == [0] * PAUSE_STEPS  # plain steps: proposing does not pay
    assert d.next_k() == 1
    for _ in range(PAUSE_AFTER_MISSES):
        d.saw(1, 0)
    assert [d.next_k() for _ in range(2 * PAUSE_STEPS)] == [0] * (2 * PAUSE_STEPS)
    assert d.next_k() == 1
    d.saw(1, 1)  # an accepted proposal ends the doubling
    assert d.pause == PAUSE_STEPS and d.next_k() == 2


# --- the generator, on a model ---------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_llama(tied=True)


def speculated(model, prompt: list[int], n: int) -> tuple[list[int], SpecStats, list]:
    kv = make_prompt_cache(model)
    model(mx.array([prompt[:-1]], dtype=mx.int32), cache=kv)
    stats = SpecStats()
    out = [t for t, _ in lookup_steps(model, kv, prompt[-1:], prompt[:-1], n, stats, verify_greedy)]
    return out, stats, kv


@pytest.mark.parametrize("shape", ["no repeats", "echoes its own answer"])
def test_prompt_lookup_gives_greedy_decodings_tokens(model, shape):
    base = [(5 * j + 3) % 97 for j in range(24)]
    if shape == "echoes its own answer":  # the prompt holds the answer greedy decoding will give: all of it matches
        answer = greedy(model, base, 40)
        prompt = base + answer + base
    else:
        prompt = base
    n = 40
    expected = greedy(model, prompt, n)
    out, stats, kv = speculated(model, prompt, n)
    assert out == expected  # exact, token for token
    assert stats.tokens == n and kv[0].offset <= len(prompt) + n
    if shape == "echoes its own answer" and expected == answer:
        assert stats.accepted > 0 and stats.forwards < n  # several tokens a forward


def test_a_proposal_never_runs_past_max_tokens(model):
    base = [(5 * j + 3) % 97 for j in range(24)]
    prompt = base + greedy(model, base, 30) + base
    for n in (1, 2, 5, 9):
        out, stats, kv = speculated(model, prompt, n)
        assert out == greedy(model, prompt, n) and len(out) == n
        assert kv[0].offset <= len(prompt) - 1 + n  # the KV allocated for the prompt and n tokens is enough
