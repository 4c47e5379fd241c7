"""POST /v1/responses on a real engine (one per module, the demo model),
driven by the official `openai` package: whole and streamed answers, input
items sent back, previous_response_id through the store and the prompt
cache, and the refusals."""

from __future__ import annotations

import openai
import pytest
import requests

from testkit import settled_health

pytestmark = pytest.mark.timeout(120)
FEW = {"max_output_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def client(shared_engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_engine.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_string_input_is_answered_as_a_response(client, shared_engine):
    r = client.responses.create(model="default", input="hello", instructions="be brief", **FEW)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "default"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # the demo model rambles
    assert isinstance(r.output_text, str) and r.output[-1].type == "message"
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "be brief" and r.max_output_tokens == 8 and r.store is True
    stored = requests.get(f"{shared_engine.url}/v1/responses/{r.id}", timeout=10)
    assert stored.status_code == 200 and stored.json()["output"][-1]["content"][0]["text"] == r.output_text


def test_function_calls_and_their_outputs_go_back_to_the_model(client):
    tools = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    items = [{"role": "user", "content": "weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"}]
    bare = client.responses.create(model="default", input=items[:1], tools=tools, **FEW)
    r = client.responses.create(model="default", input=items, tools=tools, **FEW)
    assert r.status == "incomplete" and r.tools[0].name == "get_weather"
    # the call and its output are in the prompt (the chat template renders them)
    assert r.usage.input_tokens > bare.usage.input_tokens + 10


def test_a_stream_is_openais_event_sequence_and_matches_the_whole_answer(client):
    whole = client.responses.create(model="default", input="stream me", **FEW)
    # The SDK's accumulator checks the events' order; as with OpenAI, an answer cut by
    # max_output_tokens ends with response.incomplete, which its get_final_response()
    # does not take (openai/openai-python#3538): the final object is that event's.
    with client.responses.stream(model="default", input="stream me", **FEW) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text  # greedy: the same answer
    assert final.usage.output_tokens == 8 and final.id == events[0].response.id


def test_previous_response_id_continues_the_conversation_from_the_prompt_cache(client, shared_engine):
    story = "tell me a story about " + ", ".join(f"the {n}th dragon" for n in range(4, 20))  # over the cache's 32 tokens
    first = client.responses.create(model="default", input=story, **FEW)
    settled_health(shared_engine.url)  # the turn is in the prompt cache once the worker is idle
    second = client.responses.create(model="default", previous_response_id=first.id, input="and then?", **FEW)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 2
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_a_hosted_tool_is_set_aside_and_named_in_a_header(client):
    tools = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}]
    raw = client.responses.with_raw_response.create(model="default", input="search", tools=tools, **FEW)
    assert raw.status_code == 200 and raw.parse().usage.output_tokens == 8
    warning = raw.headers["x-mlxd-warning"]
    assert "web_search tool" in warning and "file_search tool" in warning
    plain = client.responses.with_raw_response.create(model="default", input="search", **FEW)
    assert "x-mlxd-warning" not in plain.headers


def test_store_false_keeps_nothing_to_continue_from(client, shared_engine):
    r = client.responses.create(model="default", input="forget me", store=False, **FEW)
    assert r.store is False
    assert requests.get(f"{shared_engine.url}/v1/responses/{r.id}", timeout=10).status_code == 404
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="default", input="again", previous_response_id=r.id, **FEW)
    assert info.value.body["code"] == "previous_response_not_found"
    assert info.value.body["param"] == "previous_response_id"


def test_a_stored_response_can_be_deleted(client, shared_engine):
    r = client.responses.create(model="default", input="keep me briefly", **FEW)
    url = f"{shared_engine.url}/v1/responses/{r.id}"
    assert requests.delete(url, timeout=10).json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    assert requests.get(url, timeout=10).status_code == 404
