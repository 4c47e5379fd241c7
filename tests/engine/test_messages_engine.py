"""POST /v1/messages (Anthropic's Messages API) on a real engine (one per
module: the demo model and the fine-tuned agent model, devkit/agent_model.py),
driven by the official `anthropic` package: whole and streamed answers, a
generated tool use and its round trip, forced tools, stop sequences, the
refusals in Anthropic's shape, and a hosted tool set aside."""

from __future__ import annotations

import anthropic
import pytest

from conftest import SHARED_ENGINE, engine_toml, running_engine
from mlxd.devkit import agent_model as agent

pytestmark = pytest.mark.timeout(600)
GREEDY = {"temperature": 0}  # the anthropic client no longer takes temperature itself
FN = agent.WEATHER_TOOL["function"]
WEATHER_TOOL = {"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}
NO_THINKING = {"type": "disabled"}  # the agent model learned its tool call with thinking off
HI = [{"role": "user", "content": "hello"}]
# Tools whose every argument is an enum: a forced call by the demo model (random text) ends within max_tokens.
TIME_TOOL = {"name": "get_time", "description": "The time in a time zone",
             "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
                              "required": ["zone"]}}
CITY_TOOL = {"name": "get_city", "description": "A city's facts",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                              "required": ["city"]}}


@pytest.fixture(scope="module")
def client(tmp_path_factory, demo_models, agent_model):
    extra = {"agent": {"path": agent_model}}
    limits = {**SHARED_ENGINE, "max_tokens_cap": 256}  # room for a forced call (the grammar lets a random model pad it)
    with running_engine(tmp_path_factory, engine_toml(demo_models, limits, extra_models=extra)) as ep:
        yield anthropic.Anthropic(base_url=ep.url, api_key="unused", max_retries=0, timeout=120)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def streamed(client, **kw):
    """The message as the SDK's stream accumulator builds it."""
    with client.messages.stream(**kw) as stream:
        return stream.get_final_message()


def test_a_message_whole_and_streamed(client):
    kw = dict(model="default", max_tokens=8, extra_body=GREEDY, system="be brief", messages=HI)
    raw = client.messages.with_raw_response.create(**kw)
    message = raw.parse()
    assert raw.headers["x-request-id"] and "x-mlxd-context-truncated" not in raw.headers
    assert message.id.startswith("msg_") and (message.type, message.role, message.model) == ("message", "assistant",
                                                                                               "default")
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None  # the demo model rambles
    assert message.usage.output_tokens == 8 and message.usage.input_tokens > 5
    assert message.usage.cache_creation_input_tokens == 0
    with client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert text_of(final) == text_of(message) and final.stop_reason == "max_tokens"  # greedy: the same answer
    assert final.usage.output_tokens == 8
    total = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == total


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    kw = dict(model="default", max_tokens=24, extra_body=GREEDY, messages=HI)
    free = text_of(client.messages.create(**kw))
    stop = free[3:6]  # three characters the greedy answer writes
    assert stop.strip(), free
    cut = client.messages.create(**kw, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text_of(cut) == free[:free.index(stop)]
    final = streamed(client, **kw, stop_sequences=[stop])
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ("stop_sequence", stop, text_of(cut))


def test_a_generated_tool_use_and_its_round_trip(client):
    kw = dict(model="agent", max_tokens=64, extra_body=GREEDY, tools=[WEATHER_TOOL], thinking=NO_THINKING)
    question = [{"role": "user", "content": agent.WEATHER_QUESTION}]
    message = client.messages.create(**kw, messages=question)
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", agent.WEATHER_ARGS)
    final = streamed(client, **kw, messages=question)
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", agent.WEATHER_ARGS)]
    assert final.stop_reason == "tool_use"
    follow_up = question + [
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": agent.WEATHER_RESULT}]}]
    answer = client.messages.create(**kw, messages=follow_up)
    assert (text_of(answer), answer.stop_reason) == (agent.WEATHER_ANSWER, "end_turn")
    with client.messages.stream(**kw, messages=follow_up) as stream:
        assert "".join(stream.text_stream) == agent.WEATHER_ANSWER


def test_reasoning_arrives_as_a_thinking_block(client):
    kw = dict(model="agent", max_tokens=64, extra_body=GREEDY, thinking={"type": "enabled", "budget_tokens": 1024},
              messages=[{"role": "user", "content": agent.THINK_QUESTION}])
    message = client.messages.create(**kw)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking.strip(), text_of(message).strip()) == (agent.THINK_REASONING,
                                                                              agent.THINK_ANSWER)
    final = streamed(client, **kw)
    assert [b.type for b in final.content] == ["thinking", "text"] and text_of(final) == text_of(message)


@pytest.mark.parametrize("choice, names", [({"type": "any"}, ("get_time", "get_city")),
                                           ({"type": "tool", "name": "get_city"}, ("get_city",))], ids=["any", "named"])
def test_a_forced_tool_is_called(client, choice, names):
    """The demo model never calls a tool of its own accord: the grammar makes it (one call: a random model
    would call again until max_tokens)."""
    kw = dict(model="default", max_tokens=256, extra_body=GREEDY, tools=[TIME_TOOL, CITY_TOOL],
              tool_choice={**choice, "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Tell me a joke."}])
    for message in (client.messages.create(**kw), streamed(client, **kw)):
        (use,) = [b for b in message.content if b.type == "tool_use"]
        assert use.name in names and use.id
        assert use.input in ({"zone": "CET"}, {"zone": "UTC"}, {"city": "Paris"}, {"city": "Oslo"})
        assert message.stop_reason == "tool_use"


def test_a_bad_request_is_a_400_in_anthropics_shape(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="default", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}])
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_request" and "tool_use" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:  # max_tokens is required, as Anthropic's
        client.post("/v1/messages", body={"model": "default", "messages": HI}, cast_to=object)
    assert info.value.body["error"]["param"] == "max_tokens"
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="nope", max_tokens=8, messages=HI)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:  # an engine limit: the gateway falls back on its code
        client.messages.create(model="default", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}]}])
    assert info.value.body["error"]["code"] == "unsupported_parameter"


def test_a_server_tool_is_set_aside_and_named(client):
    raw = client.messages.with_raw_response.create(
        model="default", max_tokens=4, messages=HI, tools=[WEATHER_TOOL, {"type": "web_search_20250305",
                                                                         "name": "web_search"}])
    assert raw.status_code == 200 and "web_search_20250305" in raw.headers["x-mlxd-warning"]
    assert raw.parse().usage.output_tokens == 4
