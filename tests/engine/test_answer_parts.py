"""The answer splitter (engine/model/answer_parts.py, on mlx-lm's TextStateMachine):
reasoning, content and tool calls as tables, and a property test that any
chunking of a text gives the same parts as the text in one piece (so the
streamed answer, concatenated, is the non-streamed one)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.engine.model.answer_parts import (AnswerSplitter, Markers, Part, closes_reasoning, opens_in_reasoning,
                                            transitions_for)

THINK = ("<think>", "</think>")
TOOL = ("<tool_call>", "</tool_call>")
BOTH = Markers(think=THINK, tool=TOOL)


def run(markers: Markers, pieces: list[str], in_reasoning: bool = False) -> list[Part]:
    splitter = AnswerSplitter(markers, in_reasoning)
    parts: list[Part] = []
    for piece in pieces:
        parts += splitter.feed(piece)
    return merged(parts + splitter.flush())


def merged(parts: list[Part]) -> list[Part]:
    """Adjacent text parts of one kind as one (how a client reads a stream)."""
    out: list[Part] = []
    for p in parts:
        if out and p.kind == out[-1].kind != "tool":
            out[-1] = Part(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


C, R, T = (lambda t: Part("content", t)), (lambda t: Part("reasoning", t)), (lambda t: Part("tool", t))


@pytest.mark.parametrize("markers, pieces, in_reasoning, expected", [
    # Tool calls (the cases the splitter before this one was held to).
    (Markers(tool=TOOL), ["hello ", "world"], False, [C("hello world")]),
    (Markers(tool=TOOL), ['<tool_call>{"name": "f"}</tool_call>'], False, [T('{"name": "f"}')]),
    (Markers(tool=TOOL), ["ok <tool", "_call>", '{"name":', ' "f"}</tool', "_call> done"], False,
     [C("ok "), T('{"name": "f"}'), C(" done")]),
    (Markers(tool=TOOL), ["a <tool_c", "x"], False, [C("a <tool_cx")]),  # a false start is released
    (Markers(tool=TOOL), ['<tool_call>{"name": "f"}', "<", "/tool_call><tool_call>{}</tool_call>"], False,
     [T('{"name": "f"}'), T("{}")]),
    (Markers(tool=TOOL), ['<tool_call>{"name": "f", "arguments": {'], False,
     [T('{"name": "f", "arguments": {')]),  # unterminated: still tried as a call
    (Markers(tool=("<tool_call>", None)), ['x<tool_call>{"a": 1}'], False, [C("x"), T('{"a": 1}')]),  # no end marker
    # Reasoning.
    (Markers(think=THINK), ["<think>plan</think>answer"], False, [R("plan"), C("answer")]),
    (Markers(think=THINK), ["<th", "ink>pl", "an</th", "ink>ans", "wer"], False, [R("plan"), C("answer")]),
    (Markers(think=THINK), ["plan</think>answer"], True, [R("plan"), C("answer")]),  # the template opened it
    (Markers(think=THINK), ["plan</think>answer"], False, [C("plan</think>answer")]),  # a stray close is text
    (Markers(think=THINK), ["<think>never closed"], False, [R("never closed")]),  # max_tokens inside reasoning
    (Markers(think=THINK), ["no reasoning at all"], False, [C("no reasoning at all")]),
    (Markers(), ["<think>a</think>b"], True, [C("<think>a</think>b")]),  # a model without markers
    # Both: reasoning, then a call.
    (BOTH, ['<think>need weather</think>', '<tool_call>{"name": "w"}</tool_call>'], False,
     [R("need weather"), T('{"name": "w"}')]),
    (BOTH, ['<think>call it now<tool_call>{"name": "w"}</tool_call>ok'], False,
     [R("call it now"), T('{"name": "w"}'), C("ok")]),
])
def test_splitter(markers, pieces, in_reasoning, expected):
    assert run(markers, pieces, in_reasoning) == expected


def test_transitions_are_only_what_the_model_has():
    assert transitions_for(Markers()) == {"normal": []}
    assert transitions_for(Markers(tool=("<a>", None)))["tool"] == []
    assert ("<tool_call>", "tool") in transitions_for(BOTH)["reasoning"]


PIECES = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "<", ">", "/", "think", "<th",
                          "ink>", "tool_", "call", "</", "hello", " ", "\n", '{"name": "f"}', "ça", "🙂", "<think"])


@settings(max_examples=300, deadline=None)
@given(text=st.lists(PIECES, max_size=30).map("".join), data=st.data(), in_reasoning=st.booleans())
def test_any_chunking_gives_the_same_parts(text, data, in_reasoning):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert run(BOTH, pieces, in_reasoning) == run(BOTH, [text], in_reasoning)


@pytest.fixture(scope="module")
def thinking_tokenizer(demo_models):
    """A real mlx-lm TokenizerWrapper whose vocabulary has the think tokens
    (the demo tokenizer with them added)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(demo_models.a))
    hf.add_tokens(["<think>", "</think>"])
    return TokenizerWrapper(hf)


@pytest.mark.parametrize("prompt, expected", [
    ("<|im_start|>assistant\n<think>\n", True),  # the template opened the block
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking switched off: an empty block
    ("<|im_start|>assistant\n", False),
    ("<think>old</think> then <think>", True),
])
def test_opens_in_reasoning(thinking_tokenizer, prompt, expected):
    tokens = thinking_tokenizer.encode(prompt, add_special_tokens=False)
    assert opens_in_reasoning(thinking_tokenizer, tokens) is expected


@pytest.mark.parametrize("prompt, expected", [
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", True),  # thinking switched off: the answer writes none
    ("<|im_start|>assistant\n<think>\n", False),  # the block opened: the answer reasons
    ("<|im_start|>assistant\n", False),  # the model may open one
    ("<think>old</think> answer<|im_end|>\n<|im_start|>assistant\n", False),  # an earlier turn's block
])
def test_closes_reasoning(thinking_tokenizer, prompt, expected):
    """A bound answer (engine/model/generation.py's bound_grammar) has no think block where the template closed it."""
    tokens = thinking_tokenizer.encode(prompt, add_special_tokens=False)
    assert closes_reasoning(thinking_tokenizer, tokens) is expected


def test_a_tokenizer_without_think_tokens_never_opens_in_reasoning(demo_models):
    from mlx_lm.utils import load

    tok = load(str(demo_models.a))[1]
    assert opens_in_reasoning(tok, tok.encode("<think>", add_special_tokens=False)) is False
