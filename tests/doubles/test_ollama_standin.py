"""The Ollama stand-in (a test double): its raw HTTP API, and LiteLLM's real
`ollama_chat/` provider talking to it — the proof that it speaks what LiteLLM uses."""

from __future__ import annotations

import asyncio
import json
import time

import litellm
import pytest
import requests

from mlxd.devkit.ollama_standin import CONTEXT_LENGTH, VERSION, marker, start_standin

pytestmark = pytest.mark.integration  # starts the stand-in's process

MODELS = ("llama3.2:3b", "qwen2.5:7b")
M = "llama3.2:3b"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
DONE_COUNTS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
               "eval_count", "eval_duration")


@pytest.fixture(scope="module")
def standin():
    sp = start_standin(MODELS)
    yield sp
    sp.stop()


@pytest.fixture
def fresh_standin():
    sp = start_standin(MODELS)
    yield sp
    sp.stop()


@pytest.fixture
def llm(standin, monkeypatch):
    """LiteLLM pointed at the stand-in. Its model-info lookups (POST /api/show) ignore the
    call's api_base and use OLLAMA_API_BASE or localhost:11434, so point that here too."""
    monkeypatch.setenv("OLLAMA_API_BASE", standin.url)
    return standin


def post_chat(url: str, **body) -> requests.Response:
    return requests.post(url + "/api/chat", json={"model": M, **body}, timeout=10)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- raw HTTP -----------------------------------------------------------------------

def test_version_and_tags(standin):
    assert requests.get(standin.url + "/api/version", timeout=5).json() == {"version": VERSION}
    tags = requests.get(standin.url + "/api/tags", timeout=5).json()
    assert [m["name"] for m in tags["models"]] == list(MODELS)
    assert all(m["model"] == m["name"] and len(m["digest"]) == 64 for m in tags["models"])


def test_chat_streams_ndjson_by_default(standin):
    r = post_chat(standin.url, messages=[{"role": "system", "content": "be brief"}, *user("hello big world")])
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]  # each line is one JSON object
    *chunks, last = lines
    assert len(chunks) == 4 and all(c["done"] is False and c["model"] == M and c["created_at"] for c in chunks)
    assert all(c["message"]["role"] == "assistant" and len(c["message"]["content"].split()) <= 2 for c in chunks)
    assert "".join(c["message"]["content"] for c in chunks) == marker(M) + "hello big world"
    assert last["done"] is True and last["done_reason"] == "stop" and last["message"]["content"] == ""
    assert all(isinstance(last[k], int) and last[k] > 0 for k in DONE_COUNTS)
    assert last["eval_count"] == 3 and last["prompt_eval_count"] == 5


def test_chat_non_streaming_is_one_object(standin):
    r = post_chat(standin.url, messages=user("why is the sky blue"), stream=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["message"] == {"role": "assistant", "content": marker(M) + "why is the sky blue"}
    assert body["done"] is True and body["done_reason"] == "stop" and body["eval_count"] == 5
    assert all(isinstance(body[k], int) and body[k] > 0 for k in DONE_COUNTS)


@pytest.mark.parametrize("stream", [True, False])
def test_num_predict_cuts_the_answer(standin, stream):
    r = post_chat(standin.url, messages=user("one two three four"), stream=stream, options={"num_predict": 2})
    objs = [json.loads(line) for line in r.text.splitlines()]
    content = "".join(o["message"]["content"] for o in objs)
    assert content == marker(M) + "one two"
    assert objs[-1]["done_reason"] == "length" and objs[-1]["eval_count"] == 2


def test_other_model_and_load_request(standin):
    r = requests.post(standin.url + "/api/chat", json={"model": "qwen2.5:7b", "messages": user("hi"), "stream": False},
                      timeout=10)
    assert r.json()["message"]["content"] == "[ollama-standin:qwen2.5:7b] hi"
    load = post_chat(standin.url, messages=[]).json()
    assert load["done"] is True and load["done_reason"] == "load"


def test_unknown_model_is_404_like_ollama(standin):
    r = requests.post(standin.url + "/api/chat", json={"model": "nope:1b", "messages": user("x")}, timeout=10)
    assert r.status_code == 404 and r.json() == {"error": "model 'nope:1b' not found"}
    r = requests.post(standin.url + "/api/show", json={"name": "nope:1b"}, timeout=10)
    assert r.status_code == 404 and r.json() == {"error": "model 'nope:1b' not found"}


def test_chunk_delay_streams_incrementally():
    sp = start_standin(MODELS, chunk_delay=0.2)
    try:
        t0 = time.monotonic()
        with requests.post(sp.url + "/api/chat", json={"model": M, "messages": user("a b c d")}, stream=True,
                           timeout=10) as r:
            arrivals = [time.monotonic() - t0 for _line in r.iter_lines() if _line]
        assert len(arrivals) == 6                        # marker + 4 words + final
        assert arrivals[0] < 0.6 and arrivals[-1] >= 5 * 0.2 - 0.05
    finally:
        sp.stop()
    assert sp.proc.poll() is not None
    with pytest.raises(requests.ConnectionError):
        requests.get(sp.url + "/api/version", timeout=2)


def test_stats_count_chat_requests(fresh_standin):
    url = fresh_standin.url
    stats = fresh_standin.stats()
    assert stats["chat_requests"] == 0 and stats["last_request"] is None
    requests.get(url + "/api/tags", timeout=5)
    assert fresh_standin.stats()["chat_requests"] == 0
    post_chat(url, messages=user("first"), stream=False)
    litellm.completion(model=f"ollama_chat/{M}", api_base=url, messages=user("second"), max_tokens=7)
    stats = fresh_standin.stats()
    assert stats["chat_requests"] == 2
    last = stats["last_request"]
    assert last["model"] == M and last["messages"][-1]["content"] == "second"
    assert last["options"]["num_predict"] == 7 and last["stream"] is False
    assert stats["requests"]["POST /api/chat"] == 2 and stats["requests"]["GET /api/tags"] == 1


# ---- through LiteLLM's real ollama_chat provider ------------------------------------

def test_litellm_completion(llm):
    resp = litellm.completion(model=f"ollama_chat/{M}", api_base=llm.url, messages=user("hello there world"))
    assert resp.choices[0].message.content == marker(M) + "hello there world"
    assert resp.choices[0].finish_reason == "stop"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (3, 3, 6)


def test_litellm_streaming(llm):
    chunks = list(litellm.completion(model=f"ollama_chat/{M}", api_base=llm.url, messages=user("hello there world"),
                                     stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) == 4 and "".join(pieces) == marker(M) + "hello there world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens == 3 and usage[-1].prompt_tokens == 3


def test_litellm_max_tokens_gives_length(llm):
    resp = litellm.completion(model=f"ollama_chat/{M}", api_base=llm.url, messages=user("a b c d e"), max_tokens=2)
    assert resp.choices[0].message.content == marker(M) + "a b"
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 2


def test_litellm_acompletion(llm):
    async def both():
        plain = await litellm.acompletion(model="ollama_chat/qwen2.5:7b", api_base=llm.url, messages=user("async hi"))
        stream = await litellm.acompletion(model="ollama_chat/qwen2.5:7b", api_base=llm.url,
                                           messages=user("async stream"), stream=True,
                                           stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return plain, chunks

    plain, chunks = asyncio.run(both())
    assert plain.choices[0].message.content == marker("qwen2.5:7b") + "async hi"
    assert plain.usage.completion_tokens == 2 and plain.usage.prompt_tokens == 2
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == marker("qwen2.5:7b") + "async stream"
    assert any(getattr(c, "usage", None) and c.usage.completion_tokens == 2 for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_tool_calls(llm, stream):
    resp = litellm.completion(model=f"ollama_chat/{M}", api_base=llm.url, messages=user("Paris"), tools=TOOLS,
                              stream=stream)
    if stream:
        resp = litellm.stream_chunk_builder(list(resp))
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert resp.choices[0].finish_reason == "tool_calls"


def test_litellm_unknown_model_raises_not_found(llm):
    with pytest.raises(litellm.NotFoundError, match="model 'nope:1b' not found"):
        litellm.completion(model="ollama_chat/nope:1b", api_base=llm.url, messages=user("x"))


def test_litellm_reads_model_info_from_api_show(llm):
    from litellm.llms.ollama.common_utils import OllamaModelInfo

    info = OllamaModelInfo().get_runtime_model_info(f"ollama_chat/{M}", api_base=llm.url)
    assert info["max_input_tokens"] == CONTEXT_LENGTH and info["supports_function_calling"] is True
    assert llm.stats()["requests"].get("POST /api/show", 0) >= 1
