"""truncate_middle through the gateway: chat completions, the Responses API and Anthropic's Messages
API alike say what was dropped (engine/model/context_overflow.py)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from mlxd.toml_text import table_lines

pytestmark = pytest.mark.timeout(300)
LIMIT = 700  # the engine's prompt limit stands for a small context (the demo model's is 4,096)


@pytest.fixture(scope="module")
def st(module_stack):
    return module_stack(gateway="", engine=table_lines({"max_prompt_tokens": LIMIT, "context_overflow": "truncate_middle",
                                                        "max_tokens_cap": 16}))


def turns(n: int) -> list[dict]:
    out = []
    for i in range(n):
        out += [{"role": "user", "content": f"step {i}: " + "explain the build of module %d " % i * 5},
                {"role": "assistant", "content": f"module {i} builds with make."}]
    return out + [{"role": "user", "content": "and the last step?"}]


def test_chat_completions_and_responses_through_the_gateway(st):
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="default", messages=turns(12), max_tokens=4)
    assert "dropped" in raw.headers["x-mlxd-context-truncated"]
    assert raw.parse().usage.model_extra["dropped_prompt_tokens"] > 0
    raw = client.responses.with_raw_response.create(model="default", input=turns(12), max_output_tokens=4)
    assert "dropped" in raw.headers["x-mlxd-context-truncated"]


def test_anthropic_messages_are_cut_to_fit_too(st):
    """Without truncate_middle this conversation is a 400 (and no Ollama runs here): it is answered."""
    client = anthropic.Anthropic(base_url=st.gateway_url, api_key=st.key, max_retries=0, timeout=120)
    message = client.messages.create(model="default", max_tokens=4, messages=turns(12))
    assert message.usage.output_tokens > 0 and message.usage.input_tokens <= LIMIT


def test_anthropic_messages_say_what_was_dropped(st):
    """The engine's own Messages route, on the fast path: the header and the usage, whole and streamed."""
    client = anthropic.Anthropic(base_url=st.gateway_url, api_key=st.key, max_retries=0, timeout=120)
    raw = client.messages.with_raw_response.create(model="default", max_tokens=4, messages=turns(12))
    assert "dropped" in raw.headers["x-mlxd-context-truncated"]
    assert raw.parse().usage.model_extra["dropped_input_tokens"] > 0
    with client.messages.stream(model="default", max_tokens=4, messages=turns(12)) as stream:
        assert "dropped" in stream.response.headers["x-mlxd-context-truncated"]
        assert stream.get_final_message().usage.model_extra["dropped_input_tokens"] > 0
