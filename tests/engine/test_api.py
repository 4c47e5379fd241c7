"""The engine's OpenAI API against a real engine process (one per module),
with the official `openai` client and `requests`."""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from testkit import chat, metric, settled_health

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def client(shared_engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_engine.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_non_stream_parses_into_openai_types(client):
    r = client.chat.completions.create(model="default", max_tokens=8, temperature=0,
                                       messages=[{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "hello"}])
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage(client):
    chunks = list(client.chat.completions.create(model="fast", max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The same request, not streamed, gives the same text (greedy decoding).
    full = client.chat.completions.create(model="fast", max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert text == full.choices[0].message.content


def test_tool_messages_and_tools_are_accepted(client):
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model="default", messages=messages, tools=tools, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens > 30


def test_seed_makes_sampling_repeatable(client):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model="default", max_tokens=12, temperature=1.0, seed=seed,
                                              messages=[{"role": "user", "content": "go"}]).choices[0].message.content
    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_stop_sequence_ends_with_stop(client):
    free = client.chat.completions.create(model="default", max_tokens=20, temperature=0,
                                          messages=[{"role": "user", "content": "x"}]).choices[0].message.content
    stop = free[5:8]
    assert stop.strip(), f"need visible text to stop on: {free!r}"
    r = client.chat.completions.create(model="default", max_tokens=20, temperature=0, stop=[stop],
                                       messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == free[:free.index(stop)]


def test_text_completions(client):
    r = client.completions.create(model="default", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and isinstance(r.choices[0].text, str)
    streamed = list(client.completions.create(model="default", prompt="Once upon a time", max_tokens=5,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_models_list_has_ids_and_required_aliases(client):
    ids = {m.id for m in client.models.list().data}
    assert {"demo-a", "demo-b", "fast", "default", "coding", "reasoning"} <= ids


def test_health_reports_what_an_operator_needs(shared_engine):
    settled_health(shared_engine.url)  # the module's earlier requests stored and let go
    h = requests.get(shared_engine.url + "/health", timeout=5)
    body = h.json()
    assert h.status_code == 200 and body["status"] == "ok" and body["worker_alive"] is True
    assert body["resident_model"] in ("demo-a", "demo-b")
    assert body["queue_depth"] == 0 and body["in_flight"] is None
    mem = body["memory"]
    assert mem["mlx_active_bytes"] > 10_000_000  # demo-a's weights are ~11.5 MB
    assert mem["mlx_peak_bytes"] >= mem["mlx_active_bytes"] and mem["rss_bytes"] > mem["mlx_active_bytes"]
    assert body["uptime_s"] > 0 and body["pid"] == shared_engine.proc.pid
    # where its start went: the process to the worker and the prompt cache's index, within start -> ready
    # (the weights' time is last_load_s: the module's requests may have loaded another model since)
    t = body["timings"]
    assert t["start_to_worker_s"] > 0 and t["prompt_cache_index_s"] >= 0 and t["last_load_s"] > 0
    assert t["mlx_lm_import_s"] >= 0
    assert (t["start_to_worker_s"] + t["mlx_lm_import_s"] + t["prompt_cache_index_s"]
            <= body["ready_at"] - body["process_started_at"])
    assert body["serving"]["model"] == body["resident_model"] and body["serving"]["decoder"] == "batch"


def test_metrics_are_prometheus_text(shared_engine):
    before = metric(shared_engine.url, "mlxd_engine_generated_tokens")
    chat(shared_engine.url, max_tokens=3)
    text = requests.get(shared_engine.url + "/metrics", timeout=5).text
    assert "# TYPE mlxd_engine_requests_total counter" in text
    assert metric(shared_engine.url, "mlxd_engine_generated_tokens") == before + 3
    assert metric(shared_engine.url, "mlxd_engine_max_observed_concurrency") == 1


def test_unknown_model_is_404_model_not_found(shared_engine):
    r = chat(shared_engine.url, model="no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("model", ["llama-70b", "heavy", "big-72b-remote"])
def test_heavy_model_refused_before_any_load(shared_engine, model):
    loads = metric(shared_engine.url, "mlxd_engine_model_loads")
    resident = shared_engine.health()["resident_model"]
    r = chat(shared_engine.url, model=model)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "model_too_large" and err["param"] == "model"
    assert "GiB" in err["message"]
    assert metric(shared_engine.url, "mlxd_engine_model_loads") == loads
    assert shared_engine.health()["resident_model"] == resident


BAD_BODIES = [
    (b"{not json", 400, None),
    (b"\xff\xfe\x00garbage", 400, None),
    (b"[1, 2, 3]", 400, None),
    (b'{"model": "default"}', 400, "messages"),
    (b'{"model": "default", "messages": []}', 400, "messages"),
    (b'{"model": "default", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role"),
    (b'{"model": "default", "messages": [{"role": "user", "content": 42}]}', 400, "messages.0.content"),
    (b'{"model": "default", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, None),
    (b'{"model": "default", "messages": [{"role": "user"}]}', 400, "messages.0"),
    (b'{"model": 5, "messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', 400, "max_tokens"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e12}', 400, "max_tokens"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', 400, "max_tokens"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}', 400, "temperature"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "n"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "stop": ["a","b","c","d","e"]}', 400, "stop"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}', 400, "logit_bias"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}}', 400, "logit_bias"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}', 400, "response_format"),
    (b'{"model": "../../etc/passwd", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
    (b'{"model": "/tmp", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "\\ud800 lone surrogate"}]}', 200, None),
]


def test_bad_input_battery_gets_openai_4xx_and_the_engine_keeps_serving(shared_engine):
    for body, status, param in BAD_BODIES:
        r = requests.post(shared_engine.url + "/v1/chat/completions", data=body, timeout=30,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == status, (body, r.status_code, r.text)
        if status != 200:
            err = r.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error", (body, err)
            if param:
                assert err["param"] == param, (body, err)
    r = requests.post(shared_engine.url + "/v1/completions", timeout=30,
                      json={"model": "default", "prompt": [1, 2, 10**6], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = requests.get(shared_engine.url + "/v1/nowhere", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    ok = chat(shared_engine.url, max_tokens=2)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert shared_engine.proc.poll() is None


def test_prompt_over_the_limit_is_400(shared_engine):
    r = chat(shared_engine.url, content="word " * 6000)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", err
    assert "4096" in err["message"]


@pytest.mark.parametrize("where", ["name", "tool_arguments", "tool_schema"])
def test_huge_text_outside_content_is_refused_before_tokenizing(shared_engine, where):
    """Every field the chat template renders counts against the prompt limit,
    not only `content`: a megabyte in a name, tool call or tool schema is a
    quick 400, never a tokenizer stall that looks like a hang."""
    huge = "x" * 1_000_000
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "default", "max_tokens": 2}
    if where == "name":
        messages[0]["name"] = huge
    elif where == "tool_arguments":
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": huge})}}]})
        messages.append({"role": "tool", "tool_call_id": "c1", "content": "ok"})
    else:
        body["tools"] = [{"type": "function", "function": {"name": "f", "description": huge}}]
    t0 = time.monotonic()
    r = requests.post(shared_engine.url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert time.monotonic() - t0 < 5  # refused from the character count, not after tokenizing
    assert requests.get(shared_engine.url + "/health", timeout=5).status_code == 200


def test_max_tokens_above_the_cap_is_clamped(shared_engine):
    r = requests.post(shared_engine.url + "/v1/completions", timeout=60,
                      json={"model": "default", "prompt": "a", "max_tokens": 500_000, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 64  # the shared engine's cap
