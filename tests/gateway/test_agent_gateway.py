"""An agent's requests through the whole service, with the openai client: a
real generated tool call (the fine-tuned agent model, devkit/agent_model.py),
its round trip and a reasoning answer, intact through the gateway on the
engine fast path and the LiteLLM path; and the same tool request answered
with a tool call by the Ollama fallback while the engine is down."""

from __future__ import annotations

import json

import openai
import pytest

from mlxd.devkit import agent_model as agent
from mlxd.devkit.ollama_standin import start_standin
from mlxd.supervisor.control import rpc
from mlxd.toml_text import dumps, table_lines
from testkit import wait_until

pytestmark = pytest.mark.timeout(600)
OLLAMA_MODEL = "llama3.2:3b"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def ollama():
    with start_standin(models=(OLLAMA_MODEL,)) as standin:  # stopped by pid at the end
        yield standin


def tool_request(client: openai.OpenAI, messages: list[dict], stream: bool):
    """(content, tool calls as (name, arguments), finish_reason)."""
    answer = client.chat.completions.create(model="agent", messages=messages, tools=[agent.WEATHER_TOOL],
                                            max_tokens=64, temperature=0, stream=stream, extra_body=NO_THINKING)
    if not stream:
        choice = answer.choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason
    chunks = [c for c in answer if c.choices]
    calls = [(c.function.name, json.loads(c.function.arguments))
             for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    return "".join(c.choices[0].delta.content or "" for c in chunks), calls, chunks[-1].choices[0].finish_reason


QUESTION = [{"role": "user", "content": agent.WEATHER_QUESTION}]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm-path"])
def test_an_agents_turns_arrive_intact(stack, agent_model, ollama, fast_path):
    st = stack(gateway=table_lines({"engine_fast_path": fast_path, "ollama_url": ollama.url}),
               models=dumps({"models": {"agent": {"path": agent_model, "ollama": OLLAMA_MODEL}}}))
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)
    for stream in (False, True):
        assert tool_request(client, QUESTION, stream) == ("", [("get_weather", agent.WEATHER_ARGS)], "tool_calls")
    # The round trip: the call as the client got it, and the tool's result.
    call = client.chat.completions.create(model="agent", messages=QUESTION, tools=[agent.WEATHER_TOOL],
                                          max_tokens=64, temperature=0,
                                          extra_body=NO_THINKING).choices[0].message.tool_calls[0]
    follow_up = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                            {"role": "tool", "tool_call_id": call.id, "content": agent.WEATHER_RESULT}]
    for stream in (False, True):
        assert tool_request(client, follow_up, stream) == (agent.WEATHER_ANSWER, [], "stop")
    # Reasoning.
    msg = client.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": agent.THINK_QUESTION}], max_tokens=64, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert ((msg.model_extra or {}).get("reasoning_content", "").strip(), msg.content.strip()) == \
        (agent.THINK_REASONING, agent.THINK_ANSWER)
    if fast_path:
        return
    # The engine down: the same tool request gets a tool call from the fallback.
    rpc(st.paths).supervisor.stopProcess("engine", True)
    asked_before = ollama.stats()["chat_requests"]
    for stream in (False, True):
        _, calls, finish = tool_request(client, QUESTION, stream)
        assert [name for name, _ in calls] == ["get_weather"] and finish == "tool_calls", stream
    assert ollama.stats()["chat_requests"] == asked_before + 2
    rpc(st.paths).supervisor.startProcess("engine", False)
    wait_until(st.healthy, 60, what="the engine back")
    assert tool_request(client, QUESTION, False)[1] == [("get_weather", agent.WEATHER_ARGS)]
