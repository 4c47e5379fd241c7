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


@pytest.mark.parametrize("rows", [1, 3])
def test_a_grammar_binds_every_step_plain_and_verify(demo_models, rows):
    """Rows under a grammar (llguidance, as a bound answer's: here lowercase
    words only), each proposing by prompt lookup from a prompt that repeats
    such text: every token is allowed by the grammar, each row decodes what
    masked greedy decoding gives it alone, and verify steps ran under the
    masks (engine/model/constrained.py's step_masks for plain steps, masks_along
    for a verify's positions)."""
    from mlx_lm import load

    from mlxd.engine.model.constrained import GrammarProcessor, grammar_tokenizer
    from mlxd.engine.model.row_proposals import LookupProposer

    model, tok = load(str(demo_models.a))
    vocab = model.model.embed_tokens.weight.shape[0] if hasattr(model, "model") else tok.vocab_size
    ll = grammar_tokenizer(tok, vocab)
    eos = sorted(tok.eos_token_ids)

    def grammar():
        return GrammarProcessor(ll, "start: /[a-z ]{1,400}/", vocab, eos)

    def masked_greedy(prompt, n):
        g, kv, token, out = grammar(), prefilled(model, prompt), prompt[-1], []
        for _ in range(n):
            logits = model(mx.array([[token]]), cache=kv)[0, -1]
            allowed = np.pad(g.allowed(), (0, logits.shape[-1] - vocab))
            token = int(mx.where(mx.array(allowed), logits, -float("inf")).argmax())
            g.advance(token)
            out.append(token)
            if token in eos:
                break
        return out

    texts = ["the cat sat on the mat and the dog sat on the log " * 6, "a b c d e f g a b c d e f g " * 8,
             "one two three four five six " * 7][:rows]
    prompts = [tok.encode(t) for t in texts]
    batch = RowBatch(model, frozenset(eos), verify_together=True)
    uids, proposers = [], []
    for prompt in prompts:
        g = grammar()
        proposers.append(LookupProposer(list(prompt), g))
        uids.append(batch.insert(prompt[-1], prefilled(model, prompt), 24, prompt[:-1], None, [g],
                                 proposer=proposers[-1], grammar=g))
    out = {u: [] for u in uids}
    while batch.rows:
        for t in batch.next():
            out[t.uid].append(t.token)
    for uid, prompt in zip(uids, prompts):
        assert out[uid] == masked_greedy(prompt, 24)
        assert all(set(tok.decode([t])) <= set("abcdefghijklmnopqrstuvwxyz ") for t in out[uid] if t not in eos)
    assert sum(p.stats.proposed for p in proposers) > 0, [p.stats for p in proposers]  # verify steps ran
