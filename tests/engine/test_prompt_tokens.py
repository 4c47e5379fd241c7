"""Chat prompts encoded piece by piece give exactly the tokens the template's
own tokenization gives: a property test over random conversations, on the
demo tokenizer and the real default model's, and the cases where the encoder
must refuse to split."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxd.engine.model.prompt_tokens import PieceEncoder, split_pattern, splittable, template_tokens
from testkit import real_default_model

# Text an agent sends: words, whitespace runs, digits, punctuation, unicode, JSON, and the
# template's own markers inside content.
PIECES = st.sampled_from(["hello", " world", "  ", "\n", "\n\n", "\t", "42", "2026-11-23T10:31:02Z", "ça", "—", "日本",
                          "{\"a\": [1, 2]}", "<|im_start|>", "<|im_end|>", "assistant", "def f(x):", "!", " .", "🙂"])
TEXT = st.lists(PIECES, min_size=0, max_size=12).map("".join)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT})
CONVERSATION = st.lists(MESSAGE, min_size=1, max_size=6)


@pytest.fixture(scope="module")
def tokenizers(demo_models, tmp_path_factory):
    from mlx_lm.utils import load

    from mlxd.engine.model.gguf_convert import convert_gguf

    return {"demo": lambda: load(str(demo_models.a))[1],  # the real model's byte-level BPE too:
            "smollm2": lambda: load(str(convert_gguf(real_default_model(), tmp_path_factory.mktemp("gguf"))))[1]}


@pytest.mark.parametrize("name", ["demo", "smollm2"])
def test_piece_by_piece_equals_the_template_tokenization(tokenizers, name):
    tok = tokenizers[name]()
    encoder = PieceEncoder(tok)
    assert encoder.enabled  # both tokenizers split cleanly at their added tokens

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(CONVERSATION)
    def check(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert encoder.encode(text) == template_tokens(tok, messages)

    check()


def test_a_later_turn_reuses_the_earlier_pieces(tokenizers):
    tok = tokenizers["demo"]()
    encoder = PieceEncoder(tok)
    calls = []
    whole = encoder._encode_whole
    encoder._encode_whole = lambda text: calls.append(text) or whole(text)  # count what really gets encoded
    history = [{"role": "system", "content": "long system prompt " * 200}, {"role": "user", "content": "one"}]
    encoder.encode(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False))
    first = sum(map(len, calls))
    calls.clear()
    history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "two"}]
    encoder.encode(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False))
    assert first > 3000 and sum(map(len, calls)) < 100  # only the new messages


@pytest.mark.parametrize("flags, expected", [
    ({}, True),
    ({"lstrip": True}, False),  # eats the whitespace before it: pieces would keep it
    ({"rstrip": True}, False),
    ({"single_word": True}, False),
    ({"normalized": True}, False),
])
def test_tokenizers_whose_added_tokens_touch_their_neighbours_are_encoded_whole(flags, expected):
    token = SimpleNamespace(content="<x>", lstrip=False, rstrip=False, single_word=False, normalized=False)
    for k, v in flags.items():
        setattr(token, k, v)
    assert splittable([token]) is expected


def test_the_split_prefers_the_longest_added_token():
    pattern = split_pattern(["<a>", "<a><b>", ""])
    assert pattern.split("x<a><b>y<a>z") == ["x", "<a><b>", "y", "<a>", "z"]
