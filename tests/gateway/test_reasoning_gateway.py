"""Reasoning through the whole service: the engine's `reasoning_content`
and the reasoning controls arrive intact through the gateway, on the engine
fast path and on the LiteLLM path, streamed and not (the openai client)."""

from __future__ import annotations

import openai
import pytest

from mlxd.toml_text import dumps, table_lines

pytestmark = pytest.mark.timeout(300)
HELLO = [{"role": "user", "content": "Tell me about the lighthouse."}]


def ask(client: openai.OpenAI, stream: bool, **extra) -> tuple[str, str]:
    """(content, reasoning_content) of a greedy answer."""
    kw = dict(model="demo-think", messages=HELLO, max_tokens=24, temperature=0, extra_body=extra)
    if not stream:
        msg = client.chat.completions.create(**kw).choices[0].message
        return msg.content or "", (msg.model_extra or {}).get("reasoning_content") or ""
    content, reasoning = [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
    return "".join(content), "".join(reasoning)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm-path"])
def test_reasoning_and_its_controls_arrive_intact(stack, think_model, fast_path):
    st = stack(gateway=table_lines({"engine_fast_path": fast_path}),
               models=dumps({"models": {"demo-think": {"path": think_model}}}))
    engine = openai.OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    gateway = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)
    on = ask(engine, False, chat_template_kwargs={"enable_thinking": True})
    off = ask(engine, False, chat_template_kwargs={"enable_thinking": False})
    assert on[1] and not off[1]  # the engine itself: reasoning when on, none when off
    for stream in (False, True):
        assert ask(gateway, stream, chat_template_kwargs={"enable_thinking": True}) == on, stream
        assert ask(gateway, stream, chat_template_kwargs={"enable_thinking": False}) == off, stream
        assert ask(gateway, stream, reasoning_effort="none") == off, stream
        assert ask(gateway, stream) == on, stream  # the model's default
