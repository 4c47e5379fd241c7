"""The Responses API's pure parts, as tables: what a request becomes as our
chat request (engine/api/responses_to_chat.py), what is refused and how, the
response object and the streamed events (engine/api/responses_builder.py), read
back by the real `openai` package (its bytes through an httpx transport: no
process), and the bounded store (engine/api/responses_store.py)."""

from __future__ import annotations

import json
import math
import os
import time

import httpx
import openai
import pytest
from pydantic import ValidationError

from mlxd.api_errors import INVALID_REQUEST, PREVIOUS_RESPONSE_NOT_FOUND, UNSUPPORTED_PARAMETER
from mlxd.engine.model.errors import EngineError
from mlxd.engine.api.request_schema import describe_validation_errors
from mlxd.engine.api.response_builder import Usage
from mlxd.engine.api.responses_api import ResponsesRequest
from mlxd.engine.api.responses_to_chat import (TranslationError, assistant_message, chat_body, input_messages,
                                           to_chat_request)
from mlxd.engine.api.responses_builder import ResponsesBuilder
from mlxd.engine.api.responses_store import DIRECT_OWNER, ResponseStore, owner_of, visible

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL = {"type": "function", "name": "get_weather", "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": False}


def req(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "default", **fields})


def refusal(body: dict) -> tuple[str, str | None, str]:
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate({"model": "default", **body})
    return describe_validation_errors(info.value.errors())


# --- the request and its translation ------------------------------------------------

@pytest.mark.parametrize("given, messages", [
    ("hi", [{"role": "user", "content": "hi"}]),
    ([{"role": "user", "content": "hi"}], [{"role": "user", "content": "hi"}]),
    ([{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be "},
                                                          {"type": "input_text", "text": "brief"}]}],
     [{"role": "developer", "content": "be brief"}]),
    # an earlier answer sent back: its text, reasoning and calls as one assistant message
    ([{"role": "user", "content": "weather?"},
      {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
      {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
       "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
      {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"},
      {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
      {"type": "function_call_output", "call_id": "c1", "output": "1"},
      {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]}],
     [{"role": "user", "content": "weather?"},
      {"role": "assistant", "content": "Checking.", "reasoning_content": "look",
       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                      {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "1"},
      {"role": "tool", "tool_call_id": "c2", "content": "2"}]),
    # calls alone: an assistant message without content; a summary stands for reasoning text
    ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}]},
      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}],
     [{"role": "assistant", "content": None, "reasoning_content": "plan",
       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
    # only encrypted reasoning: nothing we can read
    ([{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
      {"role": "assistant", "content": "ok"}], [{"role": "assistant", "content": "ok"}]),
    ([{"role": "user", "content": [{"type": "input_text", "text": "what is it"},
                                   {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"}]}],
     [{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA",
                                                                       "detail": "low"}}]}]),
])
def test_input_items_become_chat_messages(given, messages):
    assert input_messages(req(input=given).input) == messages


def test_a_request_becomes_our_chat_request():
    r = req(input="hi", instructions="be brief", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False, max_output_tokens=16, temperature=0, top_p=0.5, seed=3, stream=True,
            reasoning={"effort": "low", "summary": "auto"}, metadata={"k": "v"}, user="u", store=False,
            truncation="disabled", include=["reasoning.encrypted_content"])
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "answer"}]
    assert chat_body(r, history) == {
        "model": "default", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "be brief"}, *history, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                                    "parameters": TOOL["parameters"], "strict": False}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
        "max_completion_tokens": 16, "temperature": 0.0, "top_p": 0.5, "seed": 3, "reasoning_effort": "low"}
    chat = to_chat_request(r, history)
    assert chat.requested_max_tokens() == 16 and chat.stream_options.include_usage
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    plain = chat_body(req(input="hi"))
    assert plain == {"model": "default", "stream": False, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fmt, response_format", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True}}),
])
def test_text_format_becomes_response_format(fmt, response_format):
    assert chat_body(req(input="x", text={"format": fmt})).get("response_format") == response_format


def test_text_format_is_enforced_by_the_chat_schema():
    """Depends on the chat schema accepting a structured response_format
    (enforced by the grammar, engine/model/grammar.py)."""
    chat = to_chat_request(req(input="x", text={"format": {"type": "json_schema", "name": "city", "strict": True,
                                                           "schema": {"type": "object",
                                                                      "properties": {"c": {"type": "string"}}}}}))
    assert chat.response_format.type == "json_schema"
    assert to_chat_request(req(input="x", text={"format": {"type": "json_object"}})).response_format.type \
        == "json_object"


@pytest.mark.parametrize("body, param, named", [
    ({"input": "x", "tools": [TOOL, {"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}]},
     "tools", ["web_search", "file_search"]),
    ({"input": "x", "tools": [{"type": "computer_use_preview"}]}, "tools", ["computer_use_preview"]),
    ({"input": "x", "tools": [{"type": "mcp", "server_label": "s"}, {"type": "code_interpreter"}]}, "tools",
     ["mcp", "code_interpreter"]),
    ({"input": "x", "tools": [{"type": "custom", "name": "c"}]}, "tools", ["custom"]),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", ["file_search"]),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", ["item_reference"]),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", ["web_search_call"]),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", ["input_file"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input", ["file_id"]),
    ({"input": "x", "background": True}, "background", ["background"]),
    ({"input": "x", "n": 2}, "n", ["n=1"]),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs", ["logprobs"]),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", ["logprobs"]),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", ["prompt"]),
    ({"input": "x", "conversation": "conv_1"}, "conversation", ["conversation"]),
])
def test_what_the_engine_cannot_honour_is_unsupported_and_named(body, param, named):
    message, got_param, code = refusal(body)
    assert code == UNSUPPORTED_PARAMETER and got_param is not None and got_param.startswith(param)
    assert all(n in message for n in named), message


@pytest.mark.parametrize("body", [
    {},  # no input and no previous_response_id
    {"input": 3},
    {"input": [{"role": "robot", "content": "x"}]},
    {"input": [{"type": "function_call", "name": "f"}]},  # no call_id
    {"input": "x", "tool_choice": "sometimes"},
    {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},  # no name
    {"input": "x", "max_output_tokens": 0},
    {"input": "x", "temperature": 3},
])
def test_malformed_requests_are_invalid_request(body):
    assert refusal(body)[2] == INVALID_REQUEST


def test_translation_errors_name_the_responses_fields():
    with pytest.raises(TranslationError) as info:  # an image in a system message: chat's rule
        to_chat_request(req(input=[{"role": "system", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]))
    assert info.value.param == "input" and info.value.code == INVALID_REQUEST
    assert info.value.message.startswith("input")
    assert to_chat_request(req(previous_response_id="resp_1"), [{"role": "user", "content": "x"}]).messages


# --- the answer -------------------------------------------------------------------------

def builder(**fields) -> tuple[ResponsesBuilder, list]:
    stored: list = []
    b = ResponsesBuilder(req(input="hi", **fields), on_complete=lambda resp, msg: stored.append((resp, msg)))
    return b, stored


def test_the_whole_response_object():
    b, stored = builder(instructions="be brief", tools=[TOOL], metadata={"k": "v"}, max_output_tokens=9)
    body = b.full("It is sunny.", "tool_calls", Usage(20, 9, 12), [CALL], "let me think")
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["status"] == "completed"
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    rs, msg, fc = body["output"]
    assert rs["id"].startswith("rs_") and rs["content"] == [{"type": "reasoning_text", "text": "let me think"}]
    assert msg["id"].startswith("msg_") and msg["role"] == "assistant" and msg["status"] == "completed"
    assert msg["content"] == [{"type": "output_text", "text": "It is sunny.", "annotations": [], "logprobs": []}]
    assert fc == {"type": "function_call", "id": fc["id"], "call_id": "call_1", "name": "get_weather",
                  "arguments": '{"city": "Paris"}', "status": "completed"}
    assert body["usage"] == {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 12, "cache_write_tokens": 0},
                             "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 29}
    assert (body["instructions"], body["metadata"], body["max_output_tokens"]) == ("be brief", {"k": "v"}, 9)
    assert body["tools"] == [TOOL] and body["tool_choice"] == "auto" and body["error"] is None
    parsed = openai.types.responses.Response.model_validate(body)  # the SDK's own types, validated
    assert parsed.output_text == "It is sunny." and parsed.usage.input_tokens_details.cached_tokens == 12
    assert stored == [(body, {"role": "assistant", "content": "It is sunny.", "reasoning_content": "let me think",
                              "tool_calls": [CALL]})]


def test_a_cut_answer_is_incomplete():
    body = builder()[0].full("abc", "length", Usage(5, 3))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert builder()[0].full("", "stop", Usage(5, 0))["output"] == []  # no text: no message item


def events_of(data: bytes) -> list[dict]:
    """The SSE events: each `event:` line's type equals its data's."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        event, payload = block.split("\n")
        doc = json.loads(payload.removeprefix("data: "))
        assert event == f"event: {doc['type']}"
        out.append(doc)
    return out


def stream_of(b: ResponsesBuilder, *steps) -> bytes:
    out = b.opening()
    for step in steps:
        out += step(b)
    return out


TEXT_AND_CALL = (lambda b: b.delta("hmm", True), lambda b: b.delta("Hel"), lambda b: b.delta(""),
                 lambda b: b.delta("lo"), lambda b: b.tool_calls([CALL]), lambda b: b.finished("tool_calls", Usage(7, 5, 3)))


def test_the_stream_is_openais_event_sequence():
    b, stored = builder()
    events = events_of(stream_of(b, *TEXT_AND_CALL))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"] == b.id
    assert [(i["type"], i["status"]) for i in final["output"]] == [("reasoning", "completed"), ("message", "completed"),
                                                                    ("function_call", "completed")]
    assert final["output"][1]["content"][0]["text"] == "Hello"
    added = events[15]["item"]
    assert added["type"] == "function_call" and added["arguments"] == "" and added["status"] == "in_progress"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 3
    assert stored[0][0] == final and stored[0][1]["content"] == "Hello"


def test_a_stream_cut_by_max_output_tokens_ends_incomplete():
    b, _ = builder()
    events = events_of(stream_of(b, lambda b: b.delta("abc"), lambda b: b.finished("length", Usage(3, 1))))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_a_failure_mid_stream_is_an_error_then_response_failed_and_nothing_is_stored():
    b, stored = builder()
    err = EngineError(500, "MLX failed", code="mlx_error")
    events = events_of(stream_of(b, lambda b: b.delta("ab"), lambda b: b.failed(err)))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2] == {"type": "error", "sequence_number": events[-2]["sequence_number"], "code": "mlx_error",
                          "message": "MLX failed", "param": None}
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "mlx_error", "message": "MLX failed"}
    assert failed["output"][0]["status"] == "incomplete" and stored == []


def sdk_client(body: bytes, stream: bool) -> openai.OpenAI:
    """The real openai client, reading these bytes as the server's answer."""
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={
            "content-type": "text/event-stream" if stream else "application/json"})
    return openai.OpenAI(base_url="http://engine.invalid/v1", api_key="k", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(answer)))


def test_the_openai_package_reads_the_stream_and_the_whole_answer():
    b, _ = builder()
    data = stream_of(b, *TEXT_AND_CALL)
    client = sdk_client(data, stream=True)
    with client.responses.stream(model="default", input="hi") as stream:  # the SDK's accumulator checks the order
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == "Hello" and final.usage.input_tokens_details.cached_tokens == 3
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[2].call_id == "call_1" and json.loads(final.output[2].arguments) == {"city": "Paris"}
    raw = list(client.responses.create(model="default", input="hi", stream=True))
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == "Hello"
    whole = builder()[0].full("Hi there", "stop", Usage(4, 2, 1))
    r = sdk_client(json.dumps(whole).encode(), stream=False).responses.create(model="default", input="hi")
    assert r.output_text == "Hi there" and r.status == "completed" and r.usage.total_tokens == 6


def test_the_openai_package_reads_a_failed_stream():
    b, _ = builder()
    data = stream_of(b, lambda b: b.delta("ab"), lambda b: b.failed(EngineError(503, "stuck", code="engine_stuck")))
    events = list(sdk_client(data, stream=True).responses.create(model="default", input="hi", stream=True))
    assert events[-2].type == "error" and events[-2].code == "engine_stuck"
    assert events[-1].type == "response.failed" and events[-1].response.error.message == "stuck"


# --- the store ----------------------------------------------------------------------------

A, B = "a" * 32, "b" * 32  # two callers' hashes (gateway/keys.owner_of_key)


def test_the_store_keeps_conversations_bounded_and_says_what_it_lost(tmp_path):
    store = ResponseStore(tmp_path / "responses", max_count=3, max_bytes=10_000)
    for i in range(5):
        store.put({"id": f"resp_{i}", "n": i}, [{"role": "user", "content": str(i)}], A)
    assert sorted(p.name for p in (tmp_path / "responses").iterdir()) == ["resp_2.json", "resp_3.json", "resp_4.json"]
    assert store.conversation("resp_4", A) == [{"role": "user", "content": "4"}]
    assert store.response("resp_3", A) == {"id": "resp_3", "n": 3}
    for lost in ("resp_0", "resp_nope", "../../etc/passwd", "resp_1/../resp_4"):
        with pytest.raises(EngineError) as info:
            store.conversation(lost, A)
        assert (info.value.status, info.value.code, info.value.param) == (400, PREVIOUS_RESPONSE_NOT_FOUND,
                                                                          "previous_response_id")
    assert (tmp_path / "responses" / "resp_4.json").stat().st_mode & 0o777 == 0o600
    # by bytes too: a big one pushes the oldest out; one over the whole bound is not kept
    store.put({"id": "resp_big", "pad": "x" * 9_850}, [], A)
    assert [store.response(f"resp_{i}", A) for i in (2, 3, 4)] == [None] * 3 and store.response("resp_big", A)
    store.put({"id": "resp_huge", "pad": "x" * 20_000}, [], A)
    assert store.response("resp_huge", A) is None and store.response("resp_big", A)
    # a new store on the same folder (a restarted engine) knows them, oldest first
    again = ResponseStore(tmp_path / "responses", max_count=2, max_bytes=100_000)
    again.put({"id": "resp_5"}, [], A)
    again.put({"id": "resp_6"}, [], A)
    assert again.response("resp_big", A) is None and again.response("resp_5", A) and again.response("resp_6", A)
    assert again.delete("resp_5", A) and not again.delete("resp_5", A) and again.response("resp_5", A) is None


def test_a_stored_response_is_its_owners_alone(tmp_path):
    store = ResponseStore(tmp_path / "responses")
    store.put({"id": "resp_a"}, [{"role": "user", "content": "secret"}], A)
    assert store.response("resp_a", A) == {"id": "resp_a"}
    for other in (B, DIRECT_OWNER):  # another key's caller, and one of the engine's own port: as for an unknown id
        assert store.response("resp_a", other) is None
        with pytest.raises(EngineError) as info:
            store.conversation("resp_a", other)
        assert info.value.code == PREVIOUS_RESPONSE_NOT_FOUND
        assert not store.delete("resp_a", other)
    assert store.response("resp_a", A) == {"id": "resp_a"}  # still there for its owner
    # one stored before owners were recorded is nobody's
    (tmp_path / "responses" / "resp_old.json").write_text(json.dumps({"response": {"id": "resp_old"}, "messages": []}))
    assert all(store.response("resp_old", who) is None for who in (A, B, DIRECT_OWNER))


def test_a_stored_response_expires(tmp_path):
    store = ResponseStore(tmp_path / "responses", ttl_s=3600)
    store.put({"id": "resp_old"}, [], A)
    store.put({"id": "resp_new"}, [], A)
    hours_ago = time.time() - 2 * 3600
    os.utime(tmp_path / "responses" / "resp_old.json", (hours_ago, hours_ago))
    assert store.response("resp_old", A) is None and not (tmp_path / "responses" / "resp_old.json").exists()
    assert store.response("resp_new", A) == {"id": "resp_new"}
    # and a new store finds the expired ones gone at its next put, oldest first
    os.utime(tmp_path / "responses" / "resp_new.json", (hours_ago, hours_ago))
    again = ResponseStore(tmp_path / "responses", ttl_s=3600)
    again.put({"id": "resp_next"}, [], A)
    assert sorted(p.name for p in (tmp_path / "responses").iterdir()) == ["resp_next.json"]


@pytest.mark.parametrize("header, owner", [
    (None, DIRECT_OWNER), ("a" * 32, "a" * 32), ("0123456789abcdef", "0123456789abcdef"),
    ("A" * 32, None), ("a" * 15, None), ("a" * 65, None), ("../x", None), ("", None),
])
def test_who_a_request_is(header, owner):
    assert owner_of(header) == owner


@pytest.mark.parametrize("stored_owner, asker, age_s, ttl_s, seen", [
    (A, A, 10, 3600, True), (A, B, 10, 3600, False), (None, A, 10, 3600, False),
    (A, A, 3601, 3600, False), (A, A, 10**9, math.inf, True),
])
def test_what_a_caller_sees(stored_owner, asker, age_s, ttl_s, seen):
    assert visible({"owner": stored_owner}, asker, 10**10, 10**10 - age_s, ttl_s) is seen


def test_a_stored_answer_continues_the_conversation():
    first = req(input="hi", instructions="be brief")
    answer = assistant_message("Hello", "", [CALL])
    conversation = [*input_messages(first.input), answer]
    follow = req(previous_response_id="resp_1", instructions="now be long",
                 input=[{"type": "function_call_output", "call_id": "call_1", "output": "18C"}])
    chat = to_chat_request(follow, conversation)
    assert [(m.role, m.text()) for m in chat.messages] == [("system", "now be long"), ("user", "hi"),
                                                           ("assistant", "Hello"), ("tool", "18C")]
    assert chat.messages[2].tool_calls[0].id == "call_1"


def test_namespace_tools_are_served_as_their_functions_and_calls_name_them_back():
    """Codex CLI sends its sub-agent tools as a `namespace` tool: its functions reach the model, and a call of one
    carries the namespace back (Codex routes calls by namespace and name)."""
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [
        {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {
            "target": {"type": "string"}}, "required": ["target"]}, "strict": False}]}
    request = req(input="hi", tools=[TOOL, namespace])
    assert [t["function"]["name"] for t in chat_body(request)["tools"]] == ["get_weather", "close_agent"]
    assert "namespace" not in json.dumps(chat_body(request)["tools"])
    close = {"id": "call_2", "type": "function", "function": {"name": "close_agent", "arguments": '{"target": "a1"}'}}
    output = ResponsesBuilder(request).full("", "tool_calls", Usage(9, 4), [CALL, close])["output"]
    assert [(item["name"], item.get("namespace")) for item in output] == [("get_weather", None),
                                                                          ("close_agent", "multi_agent_v1")]
    # hosted tools beside it are still refused, by name
    message, _, code = refusal({"input": "x", "tools": [namespace, {"type": "web_search"}]})
    assert code == UNSUPPORTED_PARAMETER and "web_search" in message and "namespace" not in message
