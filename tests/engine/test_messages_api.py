"""Anthropic's Messages API's pure parts, as tables: what a request becomes as
our chat request (engine/api/messages_api.py), what is refused and how, the
message and the streamed events (engine/api/messages_builder.py), read back by
the real `anthropic` package (its bytes through an httpx2 transport: no
process), and Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx2  # the anthropic package's own httpx
import pytest
from pydantic import ValidationError

from mlxd.api_errors import INVALID_REQUEST, UNSUPPORTED_PARAMETER, anthropic_error_body, error_body_for
from mlxd.engine.api.messages_api import MessagesRequest, chat_body, to_chat_request
from mlxd.engine.api.messages_builder import MessagesBuilder
from mlxd.engine.api.request_schema import describe_validation_errors
from mlxd.engine.api.response_builder import Usage
from mlxd.engine.api.responses_to_chat import TranslationError
from mlxd.engine.model.errors import EngineError
from mlxd.engine.model.events import Started
from mlxd.engine.model.context_overflow import Truncation

TOOL = {"name": "get_weather", "description": "the weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["input_schema"],
                                              "description": "the weather"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HI = [{"role": "user", "content": "hi"}]
PNG = "iVBORw0KGgo="


def req(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "default", "max_tokens": 16, "messages": HI, **fields})


def refusal(**body) -> tuple[str, str | None, str]:
    with pytest.raises(ValidationError) as info:
        req(**body)
    return describe_validation_errors(info.value.errors())


# --- the request and its translation ------------------------------------------------

@pytest.mark.parametrize("system, messages, chat", [
    (None, HI, HI),
    ("be brief", HI, [{"role": "system", "content": "be brief"}, *HI]),
    # system blocks stay apart (Claude Code's billing header is its own block: stripped whole), cache_control ignored
    ([{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
      {"type": "text", "text": "You are a coder.", "cache_control": {"type": "ephemeral"}}], HI,
     [{"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                                     {"type": "text", "text": "You are a coder."}]}, *HI]),
    (None, [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
     [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
    # images: base64 as a data URL, a URL as it is (the engine's image rules decide which it opens)
    (None, [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "text", "text": "what is it"}]}],
     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                                   {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                   {"type": "text", "text": "what is it"}]}]),
    # a plain-text document is its text
    (None, [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "the doc"}},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "two"}]}}]}],
     [{"role": "user", "content": [{"type": "text", "text": "the doc"}, {"type": "text", "text": "two"}]}]),
    # the tool round trip: reasoning, text and calls as one assistant message; results as tool messages, in
    # order, before the turn's text; an error result says so; redacted reasoning is dropped
    (None, [{"role": "user", "content": "weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "two calls", "signature": "sig"},
                {"type": "redacted_thinking", "data": "Enc"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "data"}]},
                {"type": "text", "text": "and now?"}]}],
     [{"role": "user", "content": "weather in Paris and Rome?"},
      {"role": "assistant", "content": "Checking.", "reasoning_content": "two calls", "tool_calls": [
          {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
          {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
      {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
      {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no data"},
      {"role": "user", "content": "and now?"}]),
    # calls alone: no content; a turn of results alone: tool messages only; an empty result is empty text
    (None, [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
     [{"role": "assistant", "content": None,
       "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "t", "content": ""}]),
])
def test_messages_become_chat_messages(system, messages, chat):
    assert chat_body(req(system=system, messages=messages))["messages"] == chat


REMINDER = {"role": "system", "content": "Available agent types: claude, Explore"}
CALLED = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}


@pytest.mark.parametrize("messages, chat", [
    # Claude Code's mid-conversation system message stays one, where it is
    ([*HI, REMINDER, {"role": "user", "content": "go"}],
     [*HI, {"role": "system", "content": [{"type": "text", "text": "Available agent types: claude, Explore"}]},
      {"role": "user", "content": "go"}]),
    # ... but after the next turn's tool results, which must follow the calls they answer
    ([*HI, CALLED, REMINDER, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"},
                                                           {"type": "text", "text": "go"}]}],
     [*HI, {"role": "assistant", "content": None,
            "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "t", "content": "1"},
      {"role": "system", "content": [{"type": "text", "text": "Available agent types: claude, Explore"}]},
      {"role": "user", "content": "go"}]),
    ([*HI, REMINDER], [*HI, {"role": "system", "content": [{"type": "text",
                                                             "text": "Available agent types: claude, Explore"}]}]),
])
def test_a_system_message_mid_conversation(messages, chat):
    assert chat_body(req(messages=messages))["messages"] == chat


@pytest.mark.parametrize("fields, expected", [
    ({}, {}),
    ({"tools": [TOOL]}, {"tools": [CHAT_TOOL]}),
    ({"tools": [{**TOOL, "type": "custom", "strict": True, "cache_control": {"type": "ephemeral"}}]},
     {"tools": [{"type": "function", "function": {**CHAT_TOOL["function"], "strict": True}}]}),
    ({"tools": [TOOL], "tool_choice": {"type": "auto"}}, {"tools": [CHAT_TOOL], "tool_choice": "auto"}),
    ({"tools": [TOOL], "tool_choice": {"type": "any"}}, {"tools": [CHAT_TOOL], "tool_choice": "required"}),
    ({"tools": [TOOL], "tool_choice": {"type": "none"}}, {"tools": [CHAT_TOOL], "tool_choice": "none"}),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}},
     {"tools": [CHAT_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "parallel_tool_calls": False}),
    ({"stop_sequences": ["\n\nHuman:"], "temperature": 0.5, "top_p": 0.9, "top_k": 40},
     {"stop": ["\n\nHuman:"], "temperature": 0.5, "top_p": 0.9, "top_k": 40}),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, {"thinking": {"type": "enabled", "budget_tokens": 2048}}),
    ({"thinking": {"type": "adaptive"}}, {"thinking": {"type": "adaptive"}}),
    ({"thinking": {"type": "interleaved-2027"}}, {}),  # a mode newer than ours: the model's default
    ({"output_format": {"type": "json_schema", "schema": {"type": "object"}}},
     {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}}),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}, "effort": "low"}},
     {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}}),
    # Anthropic's convention: what is not known is ignored
    ({"metadata": {"user_id": "u1"}, "service_tier": "auto", "context_management": {"edits": []}}, {}),
])
def test_a_request_becomes_our_chat_request(fields, expected):
    body = chat_body(req(**fields))
    assert body == {"model": "default", "messages": HI, "stream": False, "max_tokens": 16, **expected}
    to_chat_request(req(**fields))  # and the chat model takes it


def test_the_chat_request_carries_the_controls():
    chat = to_chat_request(req(stream=True, tools=[TOOL], tool_choice={"type": "any"},
                               thinking={"type": "disabled"}, stop_sequences=["END"], max_tokens=7))
    assert chat.stream and chat.requested_max_tokens() == 7 and chat.stop == ["END"]
    assert chat.template_kwargs() == {"enable_thinking": False}
    assert chat.output_rules().tool_choice == "required"
    assert to_chat_request(req(thinking={"type": "enabled", "budget_tokens": 1024})).template_kwargs() == {
        "enable_thinking": True}


@pytest.mark.parametrize("body, param, named", [
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}]}]},
     "messages.0.content.0.document.source", "'base64' source"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]}]},
     "messages.0.content.0.tool_result.content", "images and documents in a tool_result"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages.0.content.0.image.source", "Files API"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools", "bash_20250124"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences", "at most 4"),
])
def test_what_the_engine_cannot_honour_is_unsupported_and_named(body, param, named):
    message, where, code = refusal(**body)
    assert (where, code) == (param, UNSUPPORTED_PARAMETER) and named in message


@pytest.mark.parametrize("body", [
    {"max_tokens": None},
    {"max_tokens": 0},
    {"messages": []},
    {"messages": [{"role": "tool", "content": "x"}]},
    {"messages": [{"role": "system", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]},
    {"tool_choice": {"type": "tool"}},
    {"tools": [{"name": "f"}]},  # input_schema is required
    {"temperature": 3},
])
def test_malformed_requests_are_invalid_request(body):
    assert refusal(**body)[2] == INVALID_REQUEST


def test_translation_errors_name_the_messages_fields():
    with pytest.raises(TranslationError) as info:
        to_chat_request(req(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}))
    assert info.value.code == INVALID_REQUEST and "nope" in info.value.message
    with pytest.raises(TranslationError) as info:
        to_chat_request(req(stop_sequences=[""]))
    assert info.value.param == "stop_sequences" and info.value.message.startswith("stop_sequences:")


# --- the answer --------------------------------------------------------------------------

@pytest.mark.parametrize("finish, stop_sequence, reason, echoed", [
    ("stop", None, "end_turn", None),
    ("stop", "END", "stop_sequence", "END"),
    ("length", None, "max_tokens", None),
    ("tool_calls", None, "tool_use", None),
    ("tool_calls", "END", "tool_use", None),
])
def test_the_stop_reason(finish, stop_sequence, reason, echoed):
    m = MessagesBuilder(req()).full("x", finish, Usage(3, 1), stop_sequence=stop_sequence)
    assert (m["stop_reason"], m["stop_sequence"]) == (reason, echoed)


def test_the_whole_message():
    m = MessagesBuilder(req(), model="demo").full("Checking.", "tool_calls", Usage(10, 4, 6, dropped_prompt_tokens=50),
                                                  [CALL], "look it up")
    assert m["id"].startswith("msg_") and (m["type"], m["role"], m["model"]) == ("message", "assistant", "demo")
    assert m["content"] == [{"type": "thinking", "thinking": "look it up", "signature": ""},
                            {"type": "text", "text": "Checking."},
                            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]
    # Anthropic counts input_tokens without the cache's; what truncate_middle dropped is said
    assert m["usage"] == {"input_tokens": 4, "output_tokens": 4, "cache_read_input_tokens": 6,
                          "cache_creation_input_tokens": 0, "dropped_input_tokens": 50}
    calls_only = MessagesBuilder(req()).full("\n", "tool_calls", Usage(3, 1), [CALL])["content"]
    assert [b["type"] for b in calls_only] == ["tool_use"]
    assert MessagesBuilder(req()).full("", "stop", Usage(3, 0))["content"] == [{"type": "text", "text": ""}]


def events_of(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for chunk in data.decode().split("\n\n"):
        if chunk:
            head, body = chunk.split("\n", 1)
            out.append((head.removeprefix("event: "), json.loads(body.removeprefix("data: "))))
    return out


def stream_of(b: MessagesBuilder, *steps) -> bytes:
    out = b.opening()
    for step in steps:
        out += step(b)
    return out


TEXT_AND_CALL = (lambda b: b.delta("hmm", True), lambda b: b.delta("Hel"), lambda b: b.delta(""),
                 lambda b: b.delta("lo"), lambda b: b.tool_calls([CALL]),
                 lambda b: b.finished("tool_calls", Usage(7, 5, 3)))


def test_the_stream_is_anthropics_event_sequence():
    b = MessagesBuilder(req(), Started(7))
    events = events_of(stream_of(b, *TEXT_AND_CALL))
    assert [kind for kind, _ in events] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert all(data["type"] == kind for kind, data in events)
    start = events[0][1]["message"]
    assert start["id"] == b.id and start["content"] == [] and start["usage"]["input_tokens"] == 7
    assert [d["index"] for k, d in events if k.startswith("content_block")] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert events[1][1]["content_block"]["type"] == "thinking"
    assert events[2][1]["delta"] == {"type": "thinking_delta", "thinking": "hmm"}
    assert events[5][1]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert events[8][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert events[9][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert events[11][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[11][1]["usage"]["cache_read_input_tokens"] == 3 and events[11][1]["usage"]["input_tokens"] == 4


def test_a_stream_says_what_was_dropped_from_its_start():
    cut = Started(300, Truncation(dropped_tokens=500, dropped_messages=6, kept_tokens=300, context_tokens=1024))
    events = events_of(stream_of(MessagesBuilder(req(), cut), lambda b: b.delta("x"),
                                 lambda b: b.finished("stop", Usage(300, 1, 0, dropped_prompt_tokens=500))))
    assert events[0][1]["message"]["usage"]["dropped_input_tokens"] == 500
    assert events[-2][1]["usage"]["dropped_input_tokens"] == 500
    data = stream_of(MessagesBuilder(req(), cut), lambda b: b.finished("stop", Usage(300, 1)))
    with sdk_client(data, stream=True).messages.stream(**ASK) as stream:
        assert stream.get_final_message().usage.model_extra["dropped_input_tokens"] == 500


def test_an_empty_stream_still_has_a_text_block():
    events = events_of(stream_of(MessagesBuilder(req()), lambda b: b.finished("stop", Usage(3, 0))))
    assert [kind for kind, _ in events] == ["message_start", "content_block_start", "content_block_stop",
                                            "message_delta", "message_stop"]


def sdk_client(body: bytes, stream: bool, status: int = 200) -> anthropic.Anthropic:
    """The real anthropic client, reading these bytes as the server's answer."""
    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, content=body, headers={
            "content-type": "text/event-stream" if stream else "application/json"})
    return anthropic.Anthropic(base_url="http://engine.invalid", api_key="k", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))


ASK = {"model": "default", "max_tokens": 16, "messages": HI}


def test_the_anthropic_package_reads_the_stream_and_the_whole_message():
    data = stream_of(MessagesBuilder(req(), Started(7)), *TEXT_AND_CALL)
    with sdk_client(data, stream=True).messages.stream(**ASK) as stream:  # the SDK's accumulator
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello" and final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "hmm" and final.content[2].input == {"city": "Paris"}
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (4, 3, 5)
    whole = MessagesBuilder(req()).full("Hi there", "stop", Usage(4, 2, 1), stop_sequence="END")
    m = sdk_client(json.dumps(whole).encode(), stream=False).messages.create(**ASK)
    assert m.content[0].text == "Hi there" and (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")
    assert m.usage.input_tokens == 3 and m.usage.cache_read_input_tokens == 1


def test_the_anthropic_package_raises_a_failed_stream():
    data = stream_of(MessagesBuilder(req()), lambda b: b.delta("ab"),
                     lambda b: b.failed(EngineError(503, "stuck", code="engine_stuck")))
    assert events_of(data)[-1] == ("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": "stuck", "code": "engine_stuck", "param": None}})
    with pytest.raises(anthropic.APIStatusError) as info:
        with sdk_client(data, stream=True).messages.stream(**ASK) as stream:
            list(stream.text_stream)
    assert info.value.body["error"]["code"] == "engine_stuck"


@pytest.mark.parametrize("status, kind, error", [
    (400, "invalid_request_error", anthropic.BadRequestError),
    (401, "authentication_error", anthropic.AuthenticationError),
    (404, "not_found_error", anthropic.NotFoundError),
    (413, "request_too_large", anthropic.APIStatusError),
    (429, "rate_limit_error", anthropic.RateLimitError),
    (500, "api_error", anthropic.InternalServerError),
    (503, "overloaded_error", anthropic.InternalServerError),
])
def test_errors_have_anthropics_shape_on_its_routes(status, kind, error):
    body = EngineError(status, "no", code="some_code", param="model").body("/v1/messages")
    assert body == anthropic_error_body(status, "no", "some_code", "model") == {
        "type": "error", "error": {"type": kind, "message": "no", "code": "some_code", "param": "model"}}
    assert error_body_for("/v1/chat/completions", status, "no", "some_code")["error"]["code"] == "some_code"
    with pytest.raises(error) as info:
        sdk_client(json.dumps(body).encode(), stream=False, status=status).messages.create(**ASK)
    assert info.value.body["error"]["type"] == kind
