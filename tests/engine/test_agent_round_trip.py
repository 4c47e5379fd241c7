"""A real generation of a tool call and of a reasoning block, through a real
engine, with the openai client: the fine-tuned agent model (devkit/agent_model.py)
writes them; the engine must hand them out as OpenAI `tool_calls` and
`reasoning_content`, streamed and not, and the tool round trip must complete."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from conftest import engine_toml, running_engine
from mlxd.devkit import agent_model as agent

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def client(tmp_path_factory, demo_models, agent_model):
    """One engine for the module: no test stops or crashes it."""
    extra = {"agent": {"path": agent_model}}
    with running_engine(tmp_path_factory, engine_toml(demo_models, {"max_tokens_cap": 64}, extra_models=extra)) as ep:
        yield OpenAI(base_url=ep.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def weather_question(client, stream: bool):
    return client.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": agent.WEATHER_QUESTION}], tools=[agent.WEATHER_TOOL],
        max_tokens=64, temperature=0, stream=stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}})


def test_a_generated_tool_call_is_an_openai_tool_call(client):
    answer = weather_question(client, stream=False).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert not answer.message.content
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == agent.WEATHER_ARGS


def test_a_generated_tool_call_streams_as_delta_tool_calls(client):
    chunks = [c for c in weather_question(client, stream=True) if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == agent.WEATHER_ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_the_tool_round_trip_completes(client):
    call = weather_question(client, stream=False).choices[0].message.tool_calls[0]
    follow_up = [{"role": "user", "content": agent.WEATHER_QUESTION},
                 {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": agent.WEATHER_RESULT}]
    for stream in (False, True):
        answer = client.chat.completions.create(
            model="agent", messages=follow_up, tools=[agent.WEATHER_TOOL], max_tokens=64, temperature=0,
            stream=stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        if stream:
            chunks = [c for c in answer if c.choices]
            text, finish = "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
        assert (text, finish) == (agent.WEATHER_ANSWER, "stop"), stream


def test_a_generated_reasoning_block_is_reasoning_content(client):
    kw = dict(model="agent", messages=[{"role": "user", "content": agent.THINK_QUESTION}], max_tokens=64,
              temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = client.chat.completions.create(**kw).choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert (reasoning.strip(), msg.content.strip()) == (agent.THINK_REASONING, agent.THINK_ANSWER)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    streamed = ("".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks),
                "".join(c.choices[0].delta.content or "" for c in chunks))
    assert streamed == (reasoning, msg.content)


def test_a_forced_call_is_bound_in_the_models_own_format(client):
    """The agent model's template renders tools and its calls are `<tool_call>` JSON (mlx-lm's json_tools): a
    named tool_choice binds the answer in that format, even for a question that is not about the tool."""
    answer = client.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": agent.THINK_QUESTION}], tools=[agent.WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and answer.finish_reason == "tool_calls"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_tool_choice_none_keeps_a_caller_from_calling(client):
    """The model calls get_weather for this question; with "none" it may not open a call, so it answers in text."""
    answer = client.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": agent.WEATHER_QUESTION}], tools=[agent.WEATHER_TOOL],
        tool_choice="none", max_tokens=24, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert not answer.message.tool_calls and "<tool_call>" not in (answer.message.content or "")
    assert answer.message.content


def test_a_json_answer_comes_after_free_reasoning(client):
    """A reasoning model thinks first, unbound; the JSON constraint starts after its `</think>`."""
    msg = client.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": agent.THINK_QUESTION}], max_tokens=64, temperature=0,
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert ((msg.model_extra or {}).get("reasoning_content") or "").strip() == agent.THINK_REASONING
    assert msg.content.lstrip().startswith("{")  # the free answer would be agent.THINK_ANSWER
