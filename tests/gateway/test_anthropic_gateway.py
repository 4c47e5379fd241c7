"""Anthropic's Messages API on the gateway (LiteLLM's own /v1/messages
route, through chat/completions to the engine), for coding agents, with the
official `anthropic` client: the same key (as `x-api-key`), the same aliases,
streamed and not, and a real generated tool use (the fine-tuned agent model,
devkit/agent_model.py) with its round trip."""

from __future__ import annotations

import anthropic
import pytest

from mlxd.devkit import agent_model as agent
from mlxd.devkit.ollama_standin import marker, start_standin
from mlxd.supervisor.control import rpc
from mlxd.toml_text import dumps, table_lines
from testkit import wait_until

pytestmark = pytest.mark.timeout(300)
GREEDY = {"temperature": 0}  # the anthropic client no longer takes temperature itself
FN = agent.WEATHER_TOOL["function"]
WEATHER_TOOL = {"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}
# The agent model learned its tool call with thinking off; Anthropic's own switch turns it off.
NO_THINKING = {"type": "disabled"}
OLLAMA_MODEL = "llama3.2:3b"
FAULT_WORD = "boom"  # injected faults fire only for prompts with this word


@pytest.fixture(scope="module")
def ollama():
    with start_standin(models=(OLLAMA_MODEL,)) as standin:  # stopped by pid at the end
        yield standin


@pytest.fixture(scope="module")
def st(module_stack, agent_model, ollama):
    return module_stack(gateway=table_lines({"ollama_url": ollama.url, "default_ollama_model": OLLAMA_MODEL}),
                        models=dumps({"models": {"agent": {"path": agent_model}}}),
                        env={"MLXD_FAULT_MATCH": FAULT_WORD})


@pytest.fixture
def client(st):
    return anthropic.Anthropic(base_url=st.gateway_url, api_key=st.key, max_retries=0, timeout=120)


def test_the_anthropic_client_gets_an_answer_streamed_and_not(client):
    kw = dict(model="default", max_tokens=12, extra_body=GREEDY,
              messages=[{"role": "user", "content": "What is the capital of France?"}])
    message = client.messages.create(**kw)
    assert message.type == "message" and message.role == "assistant"
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text and message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == message.stop_reason


def test_a_generated_tool_use_and_its_round_trip(client):
    kw = dict(model="agent", max_tokens=64, extra_body=GREEDY, tools=[WEATHER_TOOL], thinking=NO_THINKING)
    question = [{"role": "user", "content": agent.WEATHER_QUESTION}]
    message = client.messages.create(**kw, messages=question)
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", agent.WEATHER_ARGS)
    with client.messages.stream(**kw, messages=question) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("get_weather", agent.WEATHER_ARGS)]
    assert final.stop_reason == "tool_use"
    follow_up = question + [
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": agent.WEATHER_RESULT}]}]
    answer = client.messages.create(**kw, messages=follow_up)
    assert "".join(b.text for b in answer.content if b.type == "text") == agent.WEATHER_ANSWER
    assert answer.stop_reason == "end_turn"


def test_server_tools_are_set_aside_and_the_client_tool_still_called(client):
    """Claude Code's hosted tools (web search and fetch, code execution) and a replayed server tool's
    blocks: the model gets the rest, the answer names what was set aside."""
    server_tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                    {"type": "web_fetch_20250910", "name": "web_fetch"},
                    {"type": "code_execution_20250825", "name": "code_execution"}]
    earlier = [{"role": "user", "content": "search the news"},
               {"role": "assistant", "content": [
                   {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
                   {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                   {"type": "text", "text": "Nothing found."}]}]
    kw = dict(model="agent", max_tokens=64, extra_body=GREEDY, thinking=NO_THINKING, tools=[WEATHER_TOOL, *server_tools])
    raw = client.messages.with_raw_response.create(**kw, messages=[{"role": "user", "content": agent.WEATHER_QUESTION}])
    for name in ("web_search_20250305", "web_fetch_20250910", "code_execution_20250825"):
        assert name in raw.headers["x-mlxd-warning"]
    message = raw.parse()
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [("get_weather",
                                                                                    agent.WEATHER_ARGS)]
    raw = client.messages.with_raw_response.create(**kw, messages=[*earlier, {"role": "user", "content": "and now?"}])
    assert "server_tool_use" in raw.headers["x-mlxd-warning"] and "web_search_tool_result" in raw.headers[
        "x-mlxd-warning"]
    assert raw.parse().usage.output_tokens > 0


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, None],
                         ids=["thinking-enabled", "model-default"])
def test_reasoning_arrives_as_a_thinking_block(client, thinking):
    # Claude-Code-style clients send `thinking: enabled` (LiteLLM must not take it to the
    # Responses API, which the engine does not serve); without it the model's default is on.
    kw = {"thinking": thinking} if thinking else {}
    message = client.messages.create(model="agent", max_tokens=64, extra_body=GREEDY, **kw,
                                     messages=[{"role": "user", "content": agent.THINK_QUESTION}])
    thinking_text = "".join(b.thinking for b in message.content if b.type == "thinking")
    text = "".join(b.text for b in message.content if b.type == "text")
    assert (thinking_text.strip(), text.strip()) == (agent.THINK_REASONING, agent.THINK_ANSWER)


def test_the_messages_route_needs_the_key(st):
    client = anthropic.Anthropic(base_url=st.gateway_url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


def test_with_the_engine_down_the_fallback_answers(client, st, ollama):
    kw = dict(model="default", max_tokens=12, messages=[{"role": "user", "content": "are you there"}])
    rpc(st.paths).supervisor.stopProcess("engine", True)
    try:
        asked_before = ollama.stats()["chat_requests"]
        message = client.messages.create(**kw)
        assert "".join(b.text for b in message.content if b.type == "text").startswith(marker(OLLAMA_MODEL).rstrip())
        with client.messages.stream(**kw) as stream:
            assert "are you there" in "".join(stream.text_stream)
        assert ollama.stats()["chat_requests"] == asked_before + 2
    finally:
        rpc(st.paths).supervisor.startProcess("engine", False)
        wait_until(st.healthy, 60, what="the engine back")


def test_an_engine_crash_mid_answer_is_never_a_silent_end(client, st):
    """The engine aborts after 60 tokens of a streamed answer: the client gets
    an explicit error, or (where nothing had reached it yet) the fallback's
    whole answer, never the engine's partial answer ended as if complete."""
    pid = st.engine_pid()
    st.fault_file.write_text("abort@token:60")
    received: list[str] = []
    try:
        try:
            with client.messages.stream(model="default", max_tokens=200, extra_body=GREEDY,
                                        messages=[{"role": "user", "content": f"{FAULT_WORD} go"}]) as stream:
                received.extend(stream.text_stream)
                stream.get_final_message()
        except anthropic.APIError:
            pass  # explicit
        else:
            assert "".join(received).startswith(marker(OLLAMA_MODEL).rstrip()), "a partial answer ended silently"
        wait_until(lambda: st.engine_pid() not in (None, pid), 60, what="the engine restarted after its abort")
        assert any(r.signal == "SIGABRT" for r in st.records())
    finally:
        st.fault_file.unlink(missing_ok=True)
        wait_until(st.healthy, 60, what="the restarted engine healthy")
