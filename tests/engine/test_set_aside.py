"""What no local model can use is set aside, not refused (engine/api/set_aside.py): tables."""

from __future__ import annotations

import asyncio
import json

import pytest

from mlxd.engine.api.set_aside import (WARNING_HEADER, SetAsideMiddleware, anthropic_request, chat_request,
                                       responses_request, set_aside_body)

FN = {"type": "function", "name": "shell", "parameters": {"type": "object"}}
CHAT_FN = {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}
CLAUDE_TOOL = {"name": "Bash", "description": "run", "input_schema": {"type": "object"}}


@pytest.mark.parametrize("req, tools, choice, names", [
    # Codex CLI: its hosted web search beside its function tools
    ({"tools": [FN, {"type": "web_search"}]}, [FN], None, ("web_search tool",)),
    ({"tools": [FN, {"type": "web_search_preview", "search_context_size": "low"}, {"type": "file_search",
                                                                                  "vector_store_ids": ["vs"]},
                {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
                {"type": "computer_use_preview", "display_width": 1024}, {"type": "local_shell"},
                {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:1"}]},
     [FN], None, ("web_search_preview tool", "file_search tool", "code_interpreter tool", "image_generation tool",
                  "computer_use_preview tool", "local_shell tool", "mcp tool")),
    # a type nobody has seen yet: set aside as well
    ({"tools": [FN, {"type": "hologram_2031", "name": "holo"}]}, [FN], None, ("hologram_2031 tool 'holo'",)),
    # only hosted tools: no tools left, and a forced choice goes with them
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, None, None, ("web_search tool",)),
    # a choice forcing a hosted tool: the model chooses among the rest
    ({"tools": [FN, {"type": "web_search"}], "tool_choice": {"type": "web_search"}}, [FN], None,
     ("web_search tool", "tool_choice 'web_search'")),
    # namespace tools stay; a hosted tool inside one goes
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [FN, {"type": "web_search"}]}]},
     [{"type": "namespace", "name": "ns", "tools": [FN]}], None, ("web_search tool",)),
    # nothing to set aside: the request as it was
    ({"tools": [FN], "tool_choice": "required"}, [FN], "required", ()),
])
def test_responses_tools(req, tools, choice, names):
    got = responses_request(req)
    assert got.names == names
    assert got.body.get("tools") == tools
    assert got.body.get("tool_choice") == choice
    assert (got.warning() is None) == (not names)


def test_responses_allowed_tools_choice_is_its_mode_over_its_tools():
    other = {**FN, "name": "read"}
    got = responses_request({"tools": [FN, other], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "read"}]}})
    assert got.body["tools"] == [other] and got.body["tool_choice"] == "required"


def test_responses_hosted_items_in_the_input_are_set_aside_and_the_rest_kept_in_order():
    items = [{"type": "message", "role": "user", "content": "find it"},
             {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
             {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"},
             {"type": "local_shell_call", "id": "ls_1"}, {"role": "user", "content": "next"},
             {"type": "item_reference", "id": "msg_1"}]
    got = responses_request({"input": items})
    assert [i.get("type") for i in got.body["input"]] == ["message", "function_call", "function_call_output", None,
                                                         "item_reference"]
    assert got.names == ("input item 'web_search_call'", "input item 'local_shell_call'")


@pytest.mark.parametrize("req, tools, names", [
    ({"tools": [CHAT_FN, {"type": "web_search"}]}, [CHAT_FN], ("web_search tool",)),
    ({"tools": [CHAT_FN], "web_search_options": {"search_context_size": "low"}}, [CHAT_FN], ("web_search_options",)),
    ({"tools": [CHAT_FN, {"type": "custom", "name": "apply_patch"}], "tool_choice": {"type": "custom",
                                                                                     "custom": {"name": "x"}}},
     [CHAT_FN], ("custom tool 'apply_patch'", "tool_choice 'custom'")),
    ({"tools": [CHAT_FN]}, [CHAT_FN], ()),
])
def test_chat_tools(req, tools, names):
    got = chat_request(req)
    assert got.names == names and got.body.get("tools") == tools
    assert "web_search_options" not in got.body


def test_anthropic_server_tools_their_blocks_and_choice():
    req = {"model": "m", "max_tokens": 10, "mcp_servers": [{"type": "url", "url": "http://127.0.0.1:1", "name": "x"}],
           "tools": [CLAUDE_TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                     {"type": "web_fetch_20250910", "name": "web_fetch"},
                     {"type": "code_execution_20250825", "name": "code_execution"}, {**CLAUDE_TOOL, "type": "custom"}],
           "tool_choice": {"type": "tool", "name": "web_search"},
           "messages": [{"role": "user", "content": "search"},
                        {"role": "assistant", "content": [
                            {"type": "text", "text": "Searching."},
                            {"type": "server_tool_use", "id": "srv_1", "name": "web_search", "input": {"q": "x"}},
                            {"type": "web_search_tool_result", "tool_use_id": "srv_1", "content": []}]},
                        {"role": "assistant", "content": [{"type": "web_fetch_tool_result", "tool_use_id": "s2"}]},
                        {"role": "user", "content": [{"type": "text", "text": "thanks"}]}]}
    got = anthropic_request(req)
    assert got.body["tools"] == [CLAUDE_TOOL, {**CLAUDE_TOOL, "type": "custom"}]
    assert "tool_choice" not in got.body and "mcp_servers" not in got.body
    assert got.body["messages"] == [req["messages"][0], {"role": "assistant", "content": [
        {"type": "text", "text": "Searching."}]}, req["messages"][3]]
    assert got.names == ("web_search_20250305 tool 'web_search'", "web_fetch_20250910 tool 'web_fetch'",
                         "code_execution_20250825 tool 'code_execution'", "tool_choice 'web_search'",
                         "content block 'server_tool_use'", "content block 'web_search_tool_result'",
                         "content block 'web_fetch_tool_result'", "mcp_servers")
    assert req["tools"][1]["type"] == "web_search_20250305"  # the caller's request is not changed


@pytest.mark.parametrize("path, body, changed", [
    ("/v1/responses", b'{"model": "m", "input": "x", "tools": [{"type": "web_search"}]}', True),
    ("/v1/responses", b'{"model": "m", "input": "x"}', False),
    ("/v1/completions", b'{"model": "m", "tools": [{"type": "web_search"}]}', False),  # no rule for that route
    ("/v1/responses", b"[1, 2]", False),  # not an object: the route's models refuse it
    ("/v1/responses", b"{not json", False),
])
def test_set_aside_body(path, body, changed):
    new, warning = set_aside_body(path, body)
    assert (warning is not None) == changed
    assert (new != body) == changed
    if changed:
        assert "web_search" in warning and json.loads(new)["input"] == "x" and "tools" not in json.loads(new)


def _run_middleware(path: str, body: bytes, chunk: int = 7) -> tuple[bytes, dict, list]:
    seen: dict = {}
    sent: list = []

    async def app(scope, receive, send):
        parts, more = [], True
        while more:
            message = await receive()
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        seen["body"], seen["headers"] = b"".join(parts), dict(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", str(len(body)).encode())]}
    asyncio.run(SetAsideMiddleware(app)(scope, receive, send))
    return seen["body"], seen["headers"], sent


def test_middleware_hands_on_the_cleaned_body_and_names_it_in_the_answer():
    body = json.dumps({"model": "m", "input": "x", "tools": [FN, {"type": "web_search"}]}).encode()
    got, headers, sent = _run_middleware("/v1/responses", body)
    assert json.loads(got)["tools"] == [FN]
    assert headers[b"content-length"] == str(len(got)).encode()
    answer_headers = dict(sent[0]["headers"])
    assert b"web_search" in answer_headers[WARNING_HEADER.encode()]


def test_middleware_passes_a_clean_body_untouched_without_a_header():
    body = json.dumps({"model": "m", "input": "x", "tools": [FN]}).encode()
    got, _, sent = _run_middleware("/v1/responses", body)
    assert got == body and WARNING_HEADER.encode() not in dict(sent[0]["headers"])


@pytest.mark.parametrize("kind", ["\r", "a\r\nx-evil: 1", "\x00\x7f", "caf\u00e9 \u2603"])
def test_the_warning_is_a_valid_header_whatever_a_tool_is_called(kind):
    """Found by the long fuzz: a tool whose type held a CR made the header invalid, and the connection dropped."""
    warning = chat_request({"tools": [CHAT_FN, {"type": kind, "function": {"name": "0"}}]}).warning()
    assert warning is not None and warning.isascii() and not any(ord(c) < 32 or ord(c) == 127 for c in warning)
