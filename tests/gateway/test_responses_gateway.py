"""POST /v1/responses through the gateway with the key: the engine answers
on the fast path, whole and streamed, and a stored conversation continues;
with the engine stopped, LiteLLM bridges the request to Ollama's chat (the
stand-in), except a continued conversation, which only the engine holds."""

from __future__ import annotations

import openai
import pytest

from mlxd.devkit.ollama_standin import marker, start_standin
from mlxd.supervisor.control import rpc
from mlxd.toml_text import table_lines
from testkit import wait_until

pytestmark = pytest.mark.timeout(300)
OLLAMA_MODEL = "llama3.2:3b"
FEW = {"max_output_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def st(module_stack):
    with start_standin(models=(OLLAMA_MODEL,)) as standin:  # stopped by pid at the end
        yield module_stack(gateway=table_lines({"ollama_url": standin.url, "default_ollama_model": OLLAMA_MODEL}))


@pytest.fixture
def client(st) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=60)


def test_the_engine_answers_whole_and_streamed_and_continues(client):
    r = client.responses.create(model="default", input="hello there", **FEW)
    assert r.id.startswith("resp_") and r.model == "default" and r.usage.output_tokens == 8
    assert not r.output_text.startswith(marker(OLLAMA_MODEL)[:15])
    events = list(client.responses.create(model="default", input="hello there", stream=True, **FEW))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    follow = client.responses.create(model="default", previous_response_id=r.id, input="go on", **FEW)
    assert follow.previous_response_id == r.id and follow.usage.input_tokens > r.usage.input_tokens


def test_what_neither_backend_honours_is_refused_at_the_gateway(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="default", input="search", background=True, **FEW)
    assert info.value.body["code"] == "unsupported_parameter" and "background" in info.value.body["message"]


def test_a_hosted_tool_is_set_aside_and_named_whichever_backend_answers(client, st):
    """Codex CLI sends its hosted web search with every request: the turn runs on the function tools."""
    tools = [{"type": "web_search"}, {"type": "function", "name": "shell", "parameters": {"type": "object"}}]
    raw = client.responses.with_raw_response.create(model="default", input="search", tools=tools, **FEW)
    assert "web_search" in raw.headers["x-mlxd-warning"] and raw.parse().status == "incomplete"
    assert not raw.parse().output_text.startswith(marker(OLLAMA_MODEL)[:15])
    rpc(st.paths).supervisor.stopProcess("engine", True)
    try:
        raw = client.responses.with_raw_response.create(model="default", input="search", tools=tools[:1], **FEW)
        assert raw.parse().output_text.startswith(marker(OLLAMA_MODEL)) and "web_search" in raw.headers[
            "x-mlxd-warning"]
    finally:
        rpc(st.paths).supervisor.startProcess("engine", False)
        wait_until(st.healthy, 60, what="engine back")


def test_with_the_engine_stopped_ollama_answers_but_a_continued_conversation_waits(client, st):
    kept = client.responses.create(model="default", input="remember this", **FEW)
    rpc(st.paths).supervisor.stopProcess("engine", True)
    try:
        r = client.responses.create(model="default", input="are you there", **FEW)
        assert r.output_text.startswith(marker(OLLAMA_MODEL)) and r.status == "completed"
        with client.responses.stream(model="default", input="streamed while down", **FEW) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            assert stream.get_final_response().output_text == text
        assert text.startswith(marker(OLLAMA_MODEL)) and "streamed while down" in text
        with pytest.raises(openai.APIStatusError) as info:  # Ollama would answer without the conversation
            client.responses.create(model="default", previous_response_id=kept.id, input="and?", **FEW)
        assert info.value.status_code == 503 and info.value.body["code"] == "engine_unavailable"
    finally:
        rpc(st.paths).supervisor.startProcess("engine", False)
        wait_until(st.healthy, 60, what="engine back")
    again = client.responses.create(model="default", previous_response_id=kept.id, input="and?", **FEW)
    assert again.previous_response_id == kept.id  # the store outlived the engine process
