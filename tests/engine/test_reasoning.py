"""Reasoning through a real engine, with the openai client: the demo model's
thinking variant (its template's `enable_thinking` switch opens `<think>`
in the prompt, so the answer is `…</think>…`) splits into
`reasoning_content` and `content`, streamed as the non-streamed message; each
control clients send reaches the switch; a model without one ignores them."""

from __future__ import annotations

import pytest
from openai import OpenAI

from conftest import engine_toml, running_engine

HELLO = [{"role": "user", "content": "Tell me about the lighthouse."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory, demo_models, think_model):
    """One engine for the module: no test stops or crashes it."""
    extra = {"demo-think": {"path": think_model}}
    with running_engine(tmp_path_factory, engine_toml(demo_models, {"max_tokens_cap": 64}, extra_models=extra)) as ep:
        yield OpenAI(base_url=ep.url + "/v1", api_key="unused", max_retries=0)


def ask(client, model="demo-think", **extra):
    r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, temperature=0, extra_body=extra)
    msg = r.choices[0].message
    return msg.content or "", (msg.model_extra or {}).get("reasoning_content") or "", r.usage.prompt_tokens


def ask_streamed(client, model="demo-think", **extra):
    content, reasoning = [], []
    for chunk in client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, temperature=0,
                                                stream=True, extra_body=extra):
        if chunk.choices:
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
    return "".join(content), "".join(reasoning)


def test_thinking_on_splits_reasoning_and_the_stream_equals_the_message(client):
    content, reasoning, _ = ask(client, chat_template_kwargs={"enable_thinking": True})
    assert reasoning  # the template opened <think>: what the model writes first is reasoning
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content
    assert ask_streamed(client, chat_template_kwargs={"enable_thinking": True}) == (content, reasoning)


def test_thinking_off_gives_content_only(client):
    content, reasoning, _ = ask(client, chat_template_kwargs={"enable_thinking": False})
    assert content and not reasoning
    assert ask_streamed(client, chat_template_kwargs={"enable_thinking": False}) == (content, "")


@pytest.mark.parametrize("control, on", [
    ({"enable_thinking": False}, False),
    ({"reasoning_effort": "none"}, False),
    ({"reasoning_effort": "high"}, True),
    ({"reasoning": {"effort": "none"}}, False),
    ({"reasoning": {"enabled": True}}, True),
    ({"thinking": {"type": "disabled"}}, False),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, True),
    ({}, True),  # the model's default (mlx-lm turns thinking on for a model that has it)
])
def test_each_control_reaches_the_templates_switch(client, control, on):
    expected = ask(client, chat_template_kwargs={"enable_thinking": on})
    assert ask(client, **control) == expected


def test_a_model_without_a_switch_ignores_the_controls(client):
    plain = ask(client, model="demo-a")
    assert plain[0] and not plain[1]
    for control in ({"chat_template_kwargs": {"enable_thinking": True}}, {"reasoning_effort": "high"},
                    {"thinking": {"type": "enabled"}}):
        assert ask(client, model="demo-a", **control) == plain


@pytest.mark.parametrize("body, fragment", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "add_generation_prompt"),
    ({"chat_template_kwargs": "yes"}, "chat_template_kwargs"),
])
def test_bad_controls_get_a_400(client, body, fragment):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        ask(client, **body)
    assert fragment in str(err.value)
