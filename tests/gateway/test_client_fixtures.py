"""The first request of each agent client, as it was released, replayed
(tests/fixtures/clients/, recorded by bench/client_requests.py through a
loopback recorder): the CLI clients (Codex CLI, Claude Code, opencode,
aider, OpenClaw) and the Python agent libraries (openai-agents on Chat Completions and
on the Responses API, pydantic-ai, instructor, langchain-openai, llm). mlxd
takes every one of them -- hosted tools set aside and named, never a 400 for
the whole request -- and answers it through the gateway. The demo model's
context (4,096) is shorter than most of the CLI clients' prompts, so the
engine refuses those with context_length_exceeded and the Ollama fallback
answers; the request itself is what is checked here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from mlxd.devkit.ollama_standin import start_standin
from mlxd.engine.api.set_aside import set_aside_body
from mlxd.gateway.routing import ENGINE_PATHS, FastRoutes, ToEngine, route_request
from mlxd.toml_text import table_lines

pytestmark = pytest.mark.timeout(300)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clients"
CLIENTS = sorted(p.stem for p in FIXTURES.glob("*.json"))
OLLAMA_MODEL = "llama3.2:3b"
# Hosted tools a client sent (by the fixture), which the answer must name as set aside.
HOSTED = {"codex": ["web_search"]}


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


CLI_CLIENTS = {"codex", "claude", "opencode", "aider", "openclaw"}
LIBRARIES = {"openai-agents", "openai-agents-responses", "pydantic-ai", "instructor", "langchain-openai", "llm"}


def test_every_client_of_the_issue_has_a_fixture():
    assert CLI_CLIENTS | LIBRARIES <= set(CLIENTS)
    for name in CLIENTS:
        fx = fixture(name)
        assert fx["method"] == "POST" and fx["path"] in ("/v1/responses", "/v1/messages", "/v1/chat/completions")
        assert "<key>" not in json.dumps(fx["headers"]) and "authorization" not in fx["headers"]
        assert fx["package"] and fx["version"], name  # which release sent it
        text = json.dumps(fx)  # the recording's key and temporary folder written as placeholders
        assert "mlxd-recording-key" not in text and "client-requests-" not in text, name


def test_each_library_sends_its_tools_and_structured_output():
    """What each library's recorded call carries (so a re-recording that lost
    it is seen): its function tools, and the structured output by its own way."""
    tools = {name: [(t.get("function") or t)["name"] for t in fixture(name)["body"].get("tools", [])]
             for name in LIBRARIES}
    assert tools == {"openai-agents": ["get_weather"], "openai-agents-responses": ["get_weather"],
                     "pydantic-ai": ["get_weather", "final_result"], "instructor": ["Person"],
                     "langchain-openai": ["get_time", "get_weather"], "llm": ["get_weather"]}
    assert fixture("openai-agents")["body"]["response_format"]["type"] == "json_schema"
    assert fixture("openai-agents-responses")["body"]["text"]["format"]["type"] == "json_schema"
    assert fixture("instructor")["body"]["tool_choice"]["function"]["name"] == "Person"
    assert fixture("llm")["body"]["stream"] is True


@pytest.mark.parametrize("name", [c for c in CLIENTS if fixture(c)["path"] in ENGINE_PATHS])
def test_the_request_models_take_it_once_hosted_tools_are_set_aside(name, tmp_path):
    """Pure: what the gateway decides for the recorded body (no 400 of any kind)."""
    from mlxd.config import load_config

    fx = fixture(name)
    body, warning = set_aside_body(fx["path"], json.dumps({**fx["body"], "model": "default"}).encode())
    for hosted in HOSTED.get(name, []):
        assert warning is not None and hosted in warning
    config = load_config(home=tmp_path)
    decision = route_request(ENGINE_PATHS[fx["path"]], body, FastRoutes.plan(config, {}))
    assert isinstance(decision, ToEngine), decision


@pytest.fixture(scope="module")
def st(module_stack):
    with start_standin(models=(OLLAMA_MODEL,)) as standin:  # stopped by pid at the end
        yield module_stack(gateway=table_lines({"ollama_url": standin.url, "default_ollama_model": OLLAMA_MODEL}))


@pytest.mark.parametrize("name", CLIENTS)
def test_the_recorded_request_is_answered_through_the_gateway(st, name):
    fx = fixture(name)
    body = {**fx["body"], "model": "default"}
    auth = {"x-api-key": st.key} if fx["path"] == "/v1/messages" else {"Authorization": f"Bearer {st.key}"}
    headers = {k: v for k, v in fx["headers"].items() if k in ("anthropic-version", "anthropic-beta", "content-type")}
    with requests.post(st.gateway_url + fx["path"], json=body, headers={**headers, **auth}, timeout=240,
                       stream=bool(body.get("stream"))) as r:
        text = r.text
        assert r.status_code == 200, text[:500]
        for hosted in HOSTED.get(name, []):
            assert hosted in r.headers["x-mlxd-warning"]
    if body.get("stream"):  # the stream ran to its end, not into an error event
        assert '"type": "error"' not in text and '"type":"error"' not in text, text[-500:]
        ends = {"/v1/responses": ("response.completed", "response.incomplete"), "/v1/messages": ("message_stop",),
                "/v1/chat/completions": ("[DONE]",)}[fx["path"]]
        assert any(end in text for end in ends), text[-500:]
    else:
        assert json.loads(text)
