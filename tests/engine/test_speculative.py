"""Prompt-lookup decoding (engine/model/speculative.py): the n-gram index and
the draft length as tables; the batch's tokens with each row proposing
(engine/model/row_proposals.py) are greedy decoding's, token for token, alone
and in a batch of rows, on a tiny random-weight llama, in process."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engine.model.row_attention import route_attention
from mlxd.engine.model.row_proposals import LookupProposer
from mlxd.engine.model.speculative import (DRAFT_MAX, VERIFY_SLOPE, DraftPolicy, NgramIndex,
                                           SampledTarget, SpecStats, accept_sampled)
from tiny_models import batch_decode, greedy, tiny_llama


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


def test_with_no_measurements_it_proposes_what_the_prior_says_pays():
    d = DraftPolicy()  # q = 1/2, a verify about as cheap as a step: a short draft pays a little
    k = d.next_k(8)
    assert 1 <= k <= DRAFT_MAX and d.next_k(0) == 0  # nothing at hand: a plain step


@pytest.mark.parametrize("accepted_of_8, overhead_steps, proposes", [
    (8, 0.0, True),     # everything accepted, verifies cheap (a GPU): propose
    (8, 1.5, True),     # everything accepted, a verify costs 2.5+ steps (this CPU): still pays
    (1, 0.0, True),     # little accepted but verifies cost nothing: a short draft still pays a little
    (1, 1.5, False),    # little accepted and verifies dear: plain steps
    (0, 1.5, False),
])
def test_it_proposes_only_where_the_measured_acceptance_and_cost_pay(accepted_of_8, overhead_steps, proposes):
    d = DraftPolicy()
    d.saw_step(0.1)
    for _ in range(12):  # enough verifies to forget the prior
        d.saw_verify(8, accepted_of_8, 0.1 * (1 + overhead_steps + VERIFY_SLOPE * 8))
    assert d.overhead == pytest.approx(overhead_steps, abs=0.05)
    assert (d.next_k(8) > 0) is proposes


def test_plain_steps_teach_it_where_copying_starts_without_a_verify():
    d = DraftPolicy()
    d.saw_step(0.1)
    for _ in range(6):
        d.saw_verify(8, 0, 0.35)  # rejected outright, and dear (2.7 steps' overhead): it stops proposing
    assert d.next_k(8) == 0
    d.saw_shadow(False)
    assert d.next_k(8) == 0
    shadowed = 0
    while d.next_k(8) == 0:  # the answer starts copying: each plain token was the index's guess
        d.saw_shadow(True)
        shadowed += 1
    assert shadowed <= 8  # a few tokens of evidence, not a probe's wait
    d.saw_verify(8, 2, 0.35)  # the copy broke off: one rejection...
    d.saw_shadow(False)  # ...and the next plain token is not the guess either
    assert d.next_k(8) == 0


@pytest.mark.parametrize("matches, proposes", [
    ([True] * 10, True), ([False] * 10, False), ([True, False] * 5, True),  # half the guesses right: k of 1-2 pays
])
def test_shadow_acceptance_alone_decides_when_verifies_are_cheap(matches, proposes):
    d = DraftPolicy()
    for m in matches:
        d.saw_shadow(m)
    assert (d.next_k(8) > 0) is proposes


# --- in the batch's step, on a model ------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    route_attention()  # as the runner does at load: several rows' attention row by row
    return tiny_llama(tied=True)


def lookup(prompt: list[int], kv) -> LookupProposer:
    return LookupProposer(list(prompt))


def speculated(model, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[SpecStats], list]:
    return batch_decode(model, prompts, n, lookup, verify_together=True)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("shape", ["no repeats", "echoes its own answer"])
def test_prompt_lookup_gives_greedy_decodings_tokens(model, shape, rows):
    prompts = []
    for r in range(rows):  # rows of different lengths, each its own text
        base = [(5 * j + 3 + r) % 97 for j in range(24 + 7 * r)]
        prompts.append(base + greedy(model, base, 40) + base if shape == "echoes its own answer" else base)
    n = 40
    out, stats, kvs = speculated(model, prompts, n)
    for prompt, tokens, s, kv in zip(prompts, out, stats, kvs):
        assert tokens == greedy(model, prompt, n)  # exact, token for token
        assert s.tokens == n and kv[0].offset <= len(prompt) + n
        if shape == "echoes its own answer":
            assert s.accepted > 0 and s.forwards < n  # several tokens a forward


def test_a_proposal_never_runs_past_max_tokens(model):
    base = [(5 * j + 3) % 97 for j in range(24)]
    prompt = base + greedy(model, base, 30) + base
    for n in (1, 2, 5, 9):
        (out,), _, (kv,) = speculated(model, [prompt], n)
        assert out == greedy(model, prompt, n) and len(out) == n
        assert kv[0].offset <= len(prompt) + n  # the KV allocated for the prompt and n tokens is enough


# --- sampled requests: the acceptance rule keeps the target's distribution --------------------
P = [0.1, 0.2, 0.3, 0.25, 0.15]
Q = [0.4, 0.1, 0.1, 0.1, 0.3]
CHI2_4DOF_1E4 = 23.51  # chi-square with 4 degrees of freedom, p = 1e-4: a seeded test that fails only if biased


def chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("proposed", [0, 2, 4])  # the proposal: unlikely, likely, in between
def test_the_acceptance_rule_draws_each_token_from_the_target(proposed):
    mx.random.seed(7)
    probs = mx.array([P, Q])
    first, second = [0] * 5, [0] * 5
    for _ in range(4000):
        out = accept_sampled(probs, [proposed])
        first[out[0]] += 1
        if len(out) == 2:  # the proposal was accepted: the next token is drawn from the next position's target
            second[out[1]] += 1
    assert chi2(first, P) < CHI2_4DOF_1E4, first
    assert sum(second) == first[proposed] and chi2(second, Q) < CHI2_4DOF_1E4, second


def test_a_sampled_target_is_make_samplers_distribution():
    from mlx_lm.sample_utils import make_sampler

    logits = mx.array([[2.0, 1.0, 0.5, -1.0, 0.0]])
    target = SampledTarget(0.7, top_k=3)
    probs = target.probs(logits)[0].tolist()
    assert probs[3] == 0 and probs[4] == 0 and sum(probs) == pytest.approx(1.0)  # top-k kept 3
    mx.random.seed(3)
    sampler = make_sampler(temp=0.7, top_k=3)
    counts = [0] * 5
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for _ in range(3000):
        counts[int(sampler(logprobs).item())] += 1
    kept = [i for i in range(5) if probs[i] > 0]
    assert chi2([counts[i] for i in kept], [probs[i] for i in kept]) < 13.8  # 2 dof, p = 1e-3


def test_a_sampled_request_decodes_by_prompt_lookup_within_its_tokens(model):
    base = [(5 * j + 3) % 97 for j in range(24)]
    prompt = base + greedy(model, base, 30) + base
    mx.random.seed(11)
    (out,), (stats,), (kv,) = batch_decode(model, [prompt], 24, lookup, SampledTarget(0.3))
    assert len(out) == 24 and all(0 <= t < 97 for t in out)
    assert kv[0].offset <= len(prompt) + 24 and stats.tokens == 24 and stats.forwards < 24
