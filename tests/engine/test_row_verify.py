"""The batch's verify step (engine/model/row_batch.py): proposed tokens
verified in one forward over each row's own KV give exactly what greedy
decoding gives, and the KV keeps only what was accepted; a grammar masks
every position of a row's verify. On a tiny random-weight llama, in process."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.model.row_attention import route_attention
from mlxd.engine.model.row_batch import RowBatch
from mlxd.engine.model.speculative import SpecStats
from tiny_models import greedy, tiny_llama

PROMPT = [(5 * j + 3) % 97 for j in range(24)]


@pytest.fixture(scope="module")
def model():
    route_attention()
    return tiny_llama(tied=True)


class Scripted:
    """A proposer that proposes what it is told, step by step (a test's stand-in for prompt lookup)."""

    def __init__(self, script) -> None:
        self.script = script  # (tokens answered so far) -> the proposal
        self.answered: list[int] = []
        self.stats = SpecStats()

    def worth_verify(self, room: int) -> bool:
        return True

    def propose(self, last: int, joining: bool, room: int) -> list[int]:
        if not joining:
            self.answered.append(last)
        return self.script(list(self.answered))[:room]

    def verified(self, proposed, kept, seconds) -> None:
        self.answered += kept
        self.stats.forwards += 1
        self.stats.proposed += len(proposed)
        self.stats.accepted += len(kept)

    def plain(self, token, joining, seconds) -> None:
        pass

    def ended(self) -> None:
        pass


def prefilled(model, prompt: list[int]) -> list:
    """The prompt but its last token in a fresh KV (the last goes into the first step)."""
    kv = make_prompt_cache(model)
    model(mx.array([prompt[:-1]], dtype=mx.int32), cache=kv)
    return kv


def wrong(token: int) -> int:
    return (token + 1) % 97


@pytest.mark.parametrize("proposal, accepted", [
    ("right 4", 4),          # the model's own continuation: every proposed token accepted, and one more
    ("right 2 then wrong", 2),
    ("wrong first", 0),      # nothing accepted: the model's own next token, as one decode step gives
    ("none", 0),             # no proposal: a plain decode step
])
def test_verified_tokens_are_what_greedy_decoding_gives(model, proposal, accepted):
    expected = greedy(model, PROMPT, 12)
    proposed = {"right 4": expected[:4], "right 2 then wrong": expected[:2] + [wrong(expected[2]), expected[3]],
                "wrong first": [wrong(expected[0])] + expected[1:4], "none": []}[proposal]
    kv = prefilled(model, PROMPT)
    batch = RowBatch(model, frozenset())
    batch.insert(PROMPT[-1], kv, 12, PROMPT[:-1], None, [], proposer=Scripted(lambda done: proposed if not done else []))
    out = [t.token for t in batch.next()]
    assert out == expected[:accepted]  # the token after them is the next step's
    assert kv[0].offset == len(PROMPT) + accepted  # the prompt's positions and the accepted tokens', no more


@pytest.mark.parametrize("rows", [1, 3])
def test_decoding_goes_on_from_verified_steps_as_if_decoded_one_by_one(model, rows):
    """Steps of verification (half right proposals), rows of different lengths
    together: each row the same tokens as greedy decoding."""
    prompts = [PROMPT + [(7 * j + r) % 97 for j in range(5 * r)] for r in range(rows)]
    expected = [greedy(model, p, 16) for p in prompts]
    batch = RowBatch(model, frozenset(), verify_together=True)
    kvs, uids = [], []

    def script(want):
        def propose(done):
            right = want[len(done) + 1:len(done) + 4]  # the row's next token is its `last`: propose after it
            return right[:2] + [wrong(right[2])] if len(right) == 3 else right
        return propose

    for p, want in zip(prompts, expected):
        kvs.append(prefilled(model, p))
        uids.append(batch.insert(p[-1], kvs[-1], 16, p[:-1], None, [], proposer=Scripted(script(want))))
    out = {u: [] for u in uids}
    while batch.rows:
        for t in batch.next():
            out[t.uid].append(t.token)
    assert [out[u] for u in uids] == expected


def test_a_grammar_masks_every_position_of_a_verify(model):
    """A row under a mask that allows only even tokens, proposing odd ones:
    every proposal is cut, and the row decodes what greedy decoding under the
    mask gives."""
    from mlxd.engine.model.row_proposals import LookupProposer

    class EvenOnly:  # a grammar as the verify step drives it (engine/model/constrained.py's GrammarProcessor)
        def __init__(self) -> None:
            self.fresh, self.taken, self.sampled = True, [], None

        def allowed(self):
            return np.arange(97) % 2 == 0

        def __call__(self, tokens, logits):
            if self.fresh:
                self.fresh = False
            else:
                self.taken.append(int(self.sampled.item()))
            return mx.where(mx.array(self.allowed()), logits, -float("inf"))

        def sampling(self, sampler):
            def tapped(lp):
                self.sampled = sampler(lp)
                return self.sampled
            return tapped

        def catch_up(self, last):
            if self.fresh:
                self.fresh = False
            else:
                self.taken.append(last)

        def took(self, kept, after):
            self.taken += kept
            self.sampled = after

        def forced(self, k):
            return []

        def masks_along(self, proposal):
            kept = []
            for t in proposal:
                if t % 2:
                    break
                kept.append(t)
            return kept, [self.allowed()] * (len(kept) + 1)

    def masked_greedy(prompt, n):
        kv, token, out = prefilled(model, prompt), prompt[-1], []
        for _ in range(n):
            logits = model(mx.array([[token]]), cache=kv)[0, -1]
            token = int(mx.where(mx.array(np.arange(97) % 2 == 0), logits, -float("inf")).argmax())
            out.append(token)
        return out

    prompt = PROMPT + [2, 4, 6, 8, 10, 12] * 3  # what follows repeats: prompt lookup proposes it
    grammar = EvenOnly()
    batch = RowBatch(model, frozenset())
    from mlx_lm.sample_utils import make_sampler

    proposer = LookupProposer(list(prompt), grammar)
    batch.insert(prompt[-1], prefilled(model, prompt), 20, prompt[:-1], grammar.sampling(make_sampler(0.0)),
                 [grammar], proposer=proposer, grammar=grammar)
    out = []
    while batch.rows:
        out += [t.token for t in batch.next()]
    assert out == masked_greedy(prompt, 20)
    assert proposer.stats.proposed > 0, proposer.stats  # verify steps ran, under the mask
    assert all(t % 2 == 0 for t in out) and grammar.taken[:len(out) - 1] == out[:len(grammar.taken[:len(out) - 1])]
