"""The agent-client libraries users point at mlxd, through the gateway with
the key, on the real default model (issue 34): each makes the call its users
make, and gets back what its users read: openai-agents (Chat Completions and
the Responses API: a forced tool call, then the structured final output),
instructor (tools, JSON schema, JSON modes), pydantic-ai (tool, native and
prompted output), langchain-openai (structured output by each method, a
named tool) and Simon Willison's llm (an extra OpenAI model of its
extra-openai-models.yaml: a streamed answer, a schema, a tool call); then one
of each at once, in the batch.

Greedy and bounded: the 135M model loops in unbounded strings, arrays and
integers until max_tokens (the schema still holds, the answer is cut), and in
an open object it adds keys until max_tokens (JSON Schema lets an object
without `additionalProperties: false` have more), so every model here is
closed (extra="forbid") with bounded fields. Nothing here reaches the
network: no tracing (openai-agents' is switched off; langsmith's is off unless
set in the environment), no token counting (tiktoken's encodings download),
prices from pydantic-ai's bundled snapshot."""

from __future__ import annotations

import asyncio
import json

import instructor
import llm
import openai
import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, ToolCallItem,
                    function_tool, set_tracing_disabled)
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from llm.parts import ToolCallPart, ToolResultPart
from pydantic import BaseModel, ConfigDict, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import NativeOutput, PromptedOutput, ToolOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from mlxd.toml_text import dumps, table_lines
from testkit import real_default_model

pytestmark = pytest.mark.timeout(300)
MODEL = "smollm2"
set_tracing_disabled(True)  # openai-agents would send its traces to OpenAI


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class City(Closed):
    # no docstring, no minLength: the prompted modes write this schema into the prompt (see PROMPTED)
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Person(Closed):
    name: str = Field(min_length=1, max_length=40)
    age: int = Field(ge=0, le=120)
    languages: list[str] = Field(max_length=3)


class Weather(Closed):
    city: str = Field(min_length=1, max_length=30)
    temperature_c: int = Field(ge=-50, le=60)


@pytest.fixture(scope="module")
def st(module_stack):
    gguf = real_default_model()
    models = dumps({"models": {MODEL: {"gguf": gguf}}})
    # 4: requests sent together are batched, a lone one is served alone
    engine = table_lines({"stuck_grace_s": 60, "max_concurrency": 4, "batching": "always"})
    return module_stack(gateway="", models=models, engine=engine)


def openai_client(st) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)


def async_openai_client(st) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)


# --- openai-agents ---------------------------------------------------------------------------------------------

def weather_agent(model) -> tuple[Agent, list[str]]:
    """An agent that must look the weather up (tool_choice "required"), then
    answer as a Weather. The tool is offered until it has been called once:
    offered again, the 135M model calls it again, turn after turn, until
    max_turns (seen: three identical calls), as a model that reads no tool
    results would; a larger model answers without it."""
    calls: list[str] = []

    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny, 21 C in {city}"

    weather_tool = function_tool(get_weather, is_enabled=lambda ctx, agent: not calls)
    agent = Agent(name="weather", instructions="Look the weather up, then report it.", model=model,
                  tools=[weather_tool], output_type=Weather,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=60))
    return agent, calls


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_calls_the_forced_tool_then_answers_in_the_output_type(st, api):
    async def run():
        client = async_openai_client(st)
        model = (OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel)(
            model=MODEL, openai_client=client)
        agent, calls = weather_agent(model)
        result = await Runner.run(agent, "What's the weather in Oslo?", max_turns=3)
        await client.close()
        return result, calls

    result, calls = asyncio.run(run())
    # the SDK validated the arguments against the tool's schema before calling it: a call recorded is a valid one
    assert len(calls) == 1 and calls[0].strip(), calls
    tool_calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert len(tool_calls) == 1 and set(json.loads(tool_calls[0].arguments)) == {"city"}
    assert isinstance(result.final_output, Weather), result.final_output


# Where a library asks for json_object and writes the schema into the system prompt (instructor's Mode.JSON,
# pydantic-ai's PromptedOutput), mlxd's grammar guarantees a JSON object, and the keys are the model's own doing.
# The 135M model follows the prompt for City and "Name a city and its country." (greedy: the same answer every
# time); for most other schemas and questions it copies the schema's keywords or renames a key, and the library
# rightly refuses the answer. So should one of these fail after a library's prompt changes, read the answer first.
PROMPTED = "Name a city and its country."


# --- instructor --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_the_response_model(st, mode):
    """TOOLS: a named tool_choice; JSON_SCHEMA: response_format json_schema (not strict)."""
    client = instructor.from_openai(openai_client(st), mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(
        model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=100,
        messages=[{"role": "user", "content": "Describe a programmer."}])
    assert isinstance(person, Person), person


def test_instructor_json_mode_returns_the_response_model(st):
    """Mode.JSON: response_format json_object (any object) and the schema in
    the system prompt, which the model must follow by itself (see PROMPTED)."""
    client = instructor.from_openai(openai_client(st), mode=instructor.Mode.JSON)
    city = client.chat.completions.create(
        model=MODEL, response_model=City, max_retries=0, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": PROMPTED}])
    assert isinstance(city, City), city


# --- pydantic-ai -------------------------------------------------------------------------------------------------

def pydantic_agent(st, output_type) -> PydanticAgent:
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=st.gateway_url + "/v1", api_key=st.key))
    return PydanticAgent(model, output_type=output_type, retries=0,
                         model_settings={"temperature": 0, "max_tokens": 80})


@pytest.mark.parametrize("output", [ToolOutput, NativeOutput, PromptedOutput],
                         ids=["tool", "native", "prompted"])
def test_pydantic_ai_returns_the_output_type(st, output):
    """ToolOutput: a required call to its final_result tool; NativeOutput:
    response_format json_schema; PromptedOutput: json_object and the schema
    in the system prompt (see PROMPTED)."""
    result = pydantic_agent(st, output(City)).run_sync(PROMPTED)
    assert isinstance(result.output, City), result.output


# --- langchain-openai --------------------------------------------------------------------------------------------

def chat_openai(st) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=st.gateway_url + "/v1", api_key=st.key, temperature=0, max_tokens=80,
                      max_retries=0, timeout=120)


@pytest.mark.parametrize("method", [None, "function_calling", "json_mode"],
                         ids=["default", "function_calling", "json_mode"])
def test_langchain_structured_output_returns_the_model(st, method):
    """The default method is json_schema (strict); function_calling names the
    schema as the tool; json_mode is json_object and the keys asked for in
    the prompt. A parse that fails returns None, never an instance."""
    llm = chat_openai(st)
    structured = llm.with_structured_output(City) if method is None else llm.with_structured_output(City,
                                                                                                    method=method)
    question = "Name a city and its country" + (", as JSON with the keys name and country." if method == "json_mode"
                                                else ".")
    assert isinstance(city := structured.invoke(question), City), city


def test_langchain_bind_tools_with_a_named_tool_makes_the_call(st):
    @tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    @tool
    def get_time(zone: str) -> str:
        """The time in a time zone."""
        return "noon"

    message = chat_openai(st).bind_tools([get_time, get_weather], tool_choice="get_weather").invoke("Tell me a joke.")
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "days"}, call
    assert isinstance(call["args"]["city"], str) and isinstance(call["args"]["days"], int), call


# --- llm (Simon Willison's) --------------------------------------------------------------------------------------

LLM_MODEL_ID = "mlxd"


@pytest.fixture
def llm_model(st, tmp_path, monkeypatch):
    """mlxd as llm's users add it: an OpenAI-compatible model in
    extra-openai-models.yaml, its key as `llm keys set mlxd` keeps it, in a
    user dir of its own (LLM_USER_PATH: none of this machine's llm set-up)."""
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: {LLM_MODEL_ID}\n  model_name: {MODEL}\n  api_base: {st.gateway_url}/v1\n"
        "  api_key_name: mlxd\n  supports_tools: true\n  supports_schema: true\n")
    (tmp_path / "keys.json").write_text(json.dumps({"mlxd": st.key}))
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    return llm.get_model(LLM_MODEL_ID)


def test_llm_streams_an_answer_with_its_usage(llm_model):
    """llm streams by default, asking for the usage in the last chunk (stream_options)."""
    response = llm_model.prompt("What is the capital of France? Answer in one word.", temperature=0, max_tokens=20)
    assert response.text().strip(), response.json()
    usage = response.usage()
    assert usage.input and usage.input > 0 and usage.output and 0 < usage.output <= 20, usage


def test_llm_answers_in_the_schema(llm_model):
    """A schema: response_format json_schema (not strict)."""
    response = llm_model.prompt(PROMPTED, schema=City, temperature=0, max_tokens=60)
    assert City.model_validate_json(response.text()), response.text()


def test_llm_tool_turns_are_answered(llm_model):
    """llm's tool loop, both of its requests: a Python function offered as a
    tool, then the call and its result handed back (llm's messages: an
    assistant tool_calls message, a tool message). llm has no option for
    tool_choice, so the model decides whether to call ("auto"), and the 135M
    model answers in text instead (seen on every wording tried, greedy); a
    call it does make must be the function's."""
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny, 21 C in {city}"

    question = "What's the weather in Oslo?"
    first = llm_model.prompt(question, tools=[get_weather], temperature=0, max_tokens=60)
    calls = first.tool_calls()
    assert calls or first.text().strip(), first.json()
    for call in calls:
        assert call.name == "get_weather" and set(call.arguments) == {"city"}, call
    call = calls[0] if calls else llm.ToolCall(name="get_weather", arguments={"city": "Oslo"}, tool_call_id="call_1")
    history = [llm.user(question),
               llm.assistant(ToolCallPart(name=call.name, arguments=call.arguments, tool_call_id=call.tool_call_id)),
               llm.tool_message(ToolResultPart(name=call.name, output=get_weather(**call.arguments),
                                               tool_call_id=call.tool_call_id))]
    second = llm_model.prompt(messages=history, tools=[get_weather], temperature=0, max_tokens=60)
    assert second.text().strip() or second.tool_calls(), second.json()


# --- all at once --------------------------------------------------------------------------------------------------

def test_one_of_each_library_at_once_in_the_batch(st):
    """Four clients' bound requests together (max_concurrency 4: one batch):
    each answer holds to its own grammar."""
    async def all_at_once():
        agents_client, instructor_client = async_openai_client(st), async_openai_client(st)
        agent = Agent(name="city", instructions="Answer with a city.", output_type=City,
                      model=OpenAIChatCompletionsModel(model=MODEL, openai_client=agents_client),
                      model_settings=ModelSettings(temperature=0, max_tokens=60))
        answers = await asyncio.gather(
            Runner.run(agent, "Name a city and its country.", max_turns=1),
            instructor.from_openai(instructor_client, mode=instructor.Mode.TOOLS).chat.completions.create(
                model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=100,
                messages=[{"role": "user", "content": "Describe a programmer."}]),
            pydantic_agent(st, ToolOutput(City)).run("Name a city and its country."),
            chat_openai(st).with_structured_output(City).ainvoke("Name a city and its country."))
        await agents_client.close()
        await instructor_client.close()
        return answers

    agent_result, person, pydantic_result, langchain_city = asyncio.run(all_at_once())
    assert isinstance(agent_result.final_output, City), agent_result.final_output
    assert isinstance(person, Person), person
    assert isinstance(pydantic_result.output, City), pydantic_result.output
    assert isinstance(langchain_city, City), langchain_city
