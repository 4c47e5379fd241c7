"""The one-row decoder's speculative step (engine/model/one_row.py,
`verify_greedy`): proposed tokens verified in one forward over the row's own
KV give exactly what greedy decoding gives, and the KV keeps only what was
accepted. On a tiny random-weight llama, in process."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.model.one_row import verify_greedy
from tiny_models import greedy, tiny_llama

PROMPT = [(5 * j + 3) % 97 for j in range(24)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(tied=True)


def prefilled(model, prompt: list[int]) -> list:
    """The prompt but its last token in a fresh KV (the last goes into the next step)."""
    kv = make_prompt_cache(model)
    model(mx.array([prompt[:-1]], dtype=mx.int32), cache=kv)
    return kv


@pytest.mark.parametrize("proposal, accepted", [
    ("right 4", 4),          # the model's own continuation: every proposed token accepted, and one more
    ("right 2 then wrong", 2),
    ("wrong first", 0),      # nothing accepted: the model's own next token, as one decode step gives
    ("none", 0),             # no proposal: a plain decode step
])
def test_verified_tokens_are_what_greedy_decoding_gives(model, proposal, accepted):
    expected = greedy(model, PROMPT, 12)
    proposed = {"right 4": expected[:4], "right 2 then wrong": expected[:2] + [(expected[2] + 1) % 97, expected[3]],
                "wrong first": [(expected[0] + 1) % 97] + expected[1:4], "none": []}[proposal]
    kv = prefilled(model, PROMPT)
    out = verify_greedy(model, kv, PROMPT[-1], proposed)
    assert out == expected[:accepted + 1]
    assert kv[0].offset == len(PROMPT) + accepted  # the prompt's positions and the accepted tokens', no more


def test_decoding_goes_on_from_a_verified_step_as_if_decoded_one_by_one(model):
    """Steps of verification (half right proposals), then the rest: the same tokens as greedy decoding."""
    expected = greedy(model, PROMPT, 16)
    kv = prefilled(model, PROMPT)
    out: list[int] = []
    last = PROMPT[-1]
    while len(out) < 16:
        right = expected[len(out):len(out) + 3]
        proposal = right[:2] + [(right[2] + 1) % 97] if len(right) == 3 else right
        step = verify_greedy(model, kv, last, proposal)
        assert 1 <= len(step) <= len(proposal) + 1
        out += step
        last = out[-1]
        assert kv[0].offset == len(PROMPT) - 1 + len(out)  # every token but the newest has its KV
    assert out[:16] == expected
