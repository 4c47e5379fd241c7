"""Bound answers on the real default model, through the gateway with real
clients (issue 34): structured outputs enforced token by token, forced tool
calls, and tools that reach a model whose chat template drops them. Served
alone (single concurrency) and in the batch (max_concurrency 4)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
import requests
from pydantic import BaseModel, Field

from mlxd.toml_text import dumps, table_lines
from testkit import real_default_model

pytestmark = pytest.mark.timeout(400)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


class Person(BaseModel):
    name: str
    age: int
    # bounded: unbound, the default model lists languages until max_tokens (the schema holds, the answer is cut)
    languages: list[str] = Field(max_length=3)


@pytest.fixture(scope="module", params=[1, 4], ids=["alone", "batched"])
def served(request, module_stack):
    gguf = real_default_model()
    models = dumps({"models": {"smollm2": {"gguf": gguf}}})
    engine = table_lines({"stuck_grace_s": 60, "max_concurrency": request.param, "batching": "always"})
    st = module_stack(gateway="", models=models, engine=engine)
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=300)
    return st, client, request.param


def ask(client, content: str, **extra):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                          **({"max_tokens": 80, "temperature": 0} | extra))


def valid_weather_call(call) -> bool:
    args = json.loads(call.function.arguments)
    return (call.function.name == "get_weather" and set(args) == {"city", "days"}
            and isinstance(args["city"], str) and isinstance(args["days"], int))


def test_parse_returns_the_pydantic_model(served):
    _, client, _ = served
    answer = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Describe a programmer as JSON."}],
        response_format=Person, max_tokens=120, temperature=0)
    person = answer.choices[0].message.parsed
    assert isinstance(person, Person), answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"


def test_json_object_streamed_parses(served):
    _, client, _ = served
    stream = ask(client, "Invent a person, as JSON.", response_format={"type": "json_object"},
                 stream=True, max_tokens=150)
    chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    assert chunks[-1].finish_reason == "stop" and isinstance(json.loads(text), dict), text


def test_a_named_tool_is_called_with_valid_arguments(served):
    _, client, _ = served
    answer = ask(client, "Tell me a joke.", tools=[WEATHER, TIME],  # the question does not even ask for it
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = answer.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and valid_weather_call(calls[0]), answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and not answer.choices[0].message.content


def test_required_makes_a_call_and_none_makes_none(served):
    _, client, _ = served
    forced = ask(client, "What's the weather in Oslo for 3 days?", tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=False)
    calls = forced.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and valid_weather_call(calls[0])
    free = ask(client, "What's the weather in Oslo for 3 days?", tools=[WEATHER], tool_choice="none", max_tokens=24)
    assert not free.choices[0].message.tool_calls and free.choices[0].message.content


def test_tools_reach_a_model_whose_template_drops_them(served):
    st, client, _ = served
    plain = ask(client, "Hi", max_tokens=1)
    with_tools = ask(client, "Hi", max_tokens=1, tools=[WEATHER])
    # SmolLM2's template renders messages only: mlxd wrote the tool into the prompt
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert requests.get(st.url + "/health", timeout=5).json()["tools"] == "mlxd"
    engine_models = requests.get(st.url + "/v1/models", timeout=5).json()["data"]
    assert {m["id"]: m.get("tools") for m in engine_models}["smollm2"] == "mlxd"


def test_anthropic_tool_choice_any_calls_a_tool(served):
    st, _, _ = served
    client = anthropic.Anthropic(base_url=st.gateway_url, api_key=st.key, max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    message = client.messages.create(model="smollm2", max_tokens=80, tools=[tool],
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                     messages=[{"role": "user", "content": "Weather in Rome for 2 days?"}])
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input.get("days"), int), message.content


def test_bound_and_free_requests_together(served):
    """Several at once (in the batch where it batches): every bound answer holds."""
    _, client, concurrency = served
    # bounded, and greedy: at temperature 0.7 the default model once wrote a 100-digit population (valid JSON
    # so far, cut by max_tokens)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 9}},
              "required": ["city", "population"], "additionalProperties": False}

    def one(i: int):
        if i % 3 == 0:
            a = ask(client, f"A city, as JSON ({i})", max_tokens=80,
                    response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema,
                                                                            "strict": True}})
            doc = json.loads(a.choices[0].message.content)
            return set(doc) == {"city", "population"} and isinstance(doc["population"], int)
        if i % 3 == 1:
            a = ask(client, f"Weather please ({i})", tools=[WEATHER], tool_choice="required",
                    parallel_tool_calls=False)
            return valid_weather_call(a.choices[0].message.tool_calls[0])
        return bool(ask(client, f"Say hello ({i})", temperature=0.7, max_tokens=12).choices[0].message.content)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, range(6 if concurrency > 1 else 3)))


def test_a_schema_the_engine_cannot_enforce_is_refused_naming_it(served):
    """Its 400 goes on to the fallback (Ollama enforces schemas too); with no
    Ollama here, the client reads the engine's reason first, as a word code."""
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "Three numbers", response_format={"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}})
    error = caught.value.body
    assert error["code"] == "unsupported_parameter" and "uniqueItems" in error["message"]
    assert error["message"].startswith("response_format.json_schema.schema")


def test_a_prompt_past_the_models_context_is_refused_at_once(served):
    """SmolLM2's context is 8,192 tokens (below the engine's max_prompt_tokens): a longer prompt is a quick
    context_length_exceeded naming the model's context, not minutes of prefill into garbage."""
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "word " * 9000, max_tokens=4)
    error = caught.value.body
    assert error["code"] == "context_length_exceeded" and "(8192 tokens)" in error["message"]
