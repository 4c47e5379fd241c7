"""What an agent client sends that no local model can use, set aside rather
than refused (pure), and the ASGI middleware that does it for the engine and
the gateway alike.

Agent clients add hosted and server-side tools (the Responses API's
`web_search`, `file_search`, `code_interpreter`, `mcp`...; Anthropic's
`web_search_20250305`, `code_execution_*`...) and replay their calls in the
conversation; a new client version adds new ones. Refusing the whole request
over one of them stops the agent on the day its client updates (Codex CLI
sends `{"type": "web_search"}` with every request), so each is taken out of
the request and named in the answer's `X-Mlxd-Warning` header, and the model
gets everything else: its function tools and the conversation. What truly
cannot be given to the model (an image in a tool result, an `item_reference`
to OpenAI's storage) still gets its 400, with the field named, from the
request models.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WARNING_HEADER = "x-mlxd-warning"

# Function tools (and the Responses API's groups of them) go to the model;
# every other tool type is a hosted or server-side one.
RESPONSES_TOOL_TYPES = ("function", "namespace")
CHAT_TOOL_TYPES = ("function",)
ANTHROPIC_TOOL_TYPES = ("custom",)  # and no type at all: a client tool
# Responses input items the engine reads (engine/api/responses_items.py INPUT_ITEMS) and the one it must refuse
# (an id of OpenAI's storage: the content is not in the request); any other item is a hosted tool's call or
# output sent back, set aside.
RESPONSES_ITEMS = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
# Anthropic content blocks the Messages route reads; any other is a server tool's use or result.
ANTHROPIC_BLOCKS = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")
# Top-level fields that ask for a hosted feature, per API.
CHAT_HOSTED_FIELDS = ("web_search_options",)
ANTHROPIC_HOSTED_FIELDS = ("mcp_servers", "container")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # no header may carry these


@dataclass(frozen=True)
class SetAside:
    body: dict[str, Any]  # the request as the model gets it
    names: tuple[str, ...] = ()  # what was taken out, as the warning names it

    def warning(self) -> str | None:
        """The header's text: ASCII without control characters, whatever a client named its tools (a CR in a
        tool's type once made the header invalid, and the server dropped the connection)."""
        if not self.names:
            return None
        text = ("set aside, not served by a local model: " + ", ".join(self.names)
                + "; the rest of the request was answered")
        return CONTROL.sub("?", text).encode("ascii", "replace").decode()


def _type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return str(kind)[:60] if kind is not None else None


def _name(tool: dict[str, Any]) -> str:
    kind = _type(tool) or "tool"
    name = tool.get("name")
    return f"{kind} tool {str(name)[:60]!r}" if isinstance(name, str) and name and name != kind else f"{kind} tool"


def _unique(names: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def responses_request(req: dict[str, Any]) -> SetAside:
    """A Responses API request without hosted tools, a tool_choice that
    forces one, or hosted tools' calls and outputs in its input. An
    `allowed_tools` choice becomes what it means for function tools: its
    mode, over the tools it lists."""
    out, names = dict(req), []
    tools = req.get("tools")
    if isinstance(tools, list):
        kept = []
        for tool in tools:
            kind = _type(tool)
            if kind is None or kind in RESPONSES_TOOL_TYPES:
                if kind == "namespace" and isinstance(tool.get("tools"), list):
                    inner = [t for t in tool["tools"] if _type(t) in (None, "function")]
                    names += [_name(t) for t in tool["tools"] if _type(t) not in (None, "function")]
                    tool = {**tool, "tools": inner}
                kept.append(tool)
            else:
                names.append(_name(tool))
        out["tools"] = kept
    choice = req.get("tool_choice")
    if isinstance(choice, dict) and _type(choice) == "allowed_tools":
        allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict) and _type(t) == "function"}
        if isinstance(out.get("tools"), list):
            out["tools"] = [t for t in out["tools"] if _type(t) != "function" or t.get("name") in allowed]
        out["tool_choice"] = choice.get("mode") if choice.get("mode") in ("auto", "required") else "auto"
    elif isinstance(choice, dict) and _type(choice) not in (None, "function"):
        names.append(f"tool_choice {_type(choice)!r}")
        out.pop("tool_choice")
    items = req.get("input")
    if isinstance(items, list):
        kept_items = [i for i in items if _type(i) is None or _type(i) in RESPONSES_ITEMS]
        names += [f"input item {_type(i)!r}" for i in items if not (_type(i) is None or _type(i) in RESPONSES_ITEMS)]
        out["input"] = kept_items
    return _finish(req, out, names)


def chat_request(req: dict[str, Any]) -> SetAside:
    """A chat completions request without tools of any type but function,
    a tool_choice naming such a tool, or `web_search_options`."""
    out, names = dict(req), []
    tools = req.get("tools")
    if isinstance(tools, list):
        out["tools"] = [t for t in tools if _type(t) in (None, *CHAT_TOOL_TYPES)]
        names += [_name(t) for t in tools if _type(t) not in (None, *CHAT_TOOL_TYPES)]
    choice = req.get("tool_choice")
    if isinstance(choice, dict) and _type(choice) not in (None, "function"):
        names.append(f"tool_choice {_type(choice)!r}")
        out.pop("tool_choice")
    for field in CHAT_HOSTED_FIELDS:
        if req.get(field) is not None:
            names.append(field)
            out.pop(field)
    return _finish(req, out, names)


def anthropic_request(req: dict[str, Any]) -> SetAside:
    """An Anthropic Messages request without server tools (web search, web
    fetch, code execution, computer use...), their uses and results in the
    conversation, a tool_choice naming one, MCP servers or a container."""
    out, names = dict(req), []
    tools = req.get("tools")
    set_aside_tools: set[str] = set()
    if isinstance(tools, list):
        kept = []
        for tool in tools:
            if _type(tool) in (None, *ANTHROPIC_TOOL_TYPES):
                kept.append(tool)
            else:
                names.append(_name(tool))
                if isinstance(tool, dict) and isinstance(tool.get("name"), str):
                    set_aside_tools.add(tool["name"])
        out["tools"] = kept
    choice = req.get("tool_choice")
    if isinstance(choice, dict) and _type(choice) == "tool" and choice.get("name") in set_aside_tools:
        names.append(f"tool_choice {choice.get('name')!r}")
        out.pop("tool_choice")
    messages = req.get("messages")
    if isinstance(messages, list):
        kept_messages = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                blocks = [b for b in content if _type(b) is None or _type(b) in ANTHROPIC_BLOCKS]
                names += [f"content block {_type(b)!r}" for b in content
                          if not (_type(b) is None or _type(b) in ANTHROPIC_BLOCKS)]
                if not blocks and content:
                    continue  # a turn that was only a server tool's use or result
                message = {**message, "content": blocks}
            kept_messages.append(message)
        out["messages"] = kept_messages
    for field in ANTHROPIC_HOSTED_FIELDS:
        if req.get(field) is not None:
            names.append(field)
            out.pop(field)
    return _finish(req, out, names)


def _finish(req: dict[str, Any], out: dict[str, Any], names: list[str]) -> SetAside:
    if not names:
        return SetAside(req if out == req else out)  # an allowed_tools choice is translated, nothing set aside
    if "tools" in out and not out["tools"] and not req.get("tools") == []:
        out.pop("tools")
        if out.get("tool_choice") in ("required", "auto", "none"):
            out.pop("tool_choice")  # forcing or allowing calls with no tool left is no longer a question
    return SetAside(out, _unique(names))


# Paths (as the engine and the gateway serve them) -> the rule for their bodies.
RULES: dict[str, Callable[[dict[str, Any]], SetAside]] = {
    "/v1/responses": responses_request, "/responses": responses_request,
    "/v1/chat/completions": chat_request, "/chat/completions": chat_request,
    "/v1/messages": anthropic_request,
}


def set_aside_body(path: str, body: bytes) -> tuple[bytes, str | None]:
    """`body` with what no local model can use taken out, and the warning
    that names it (None when nothing was; the body untouched when nothing
    changed: a body that is not a JSON object is the request models' to refuse)."""
    rule = RULES.get(path)
    if rule is None:
        return body, None
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        return body, None
    if not isinstance(req, dict):
        return body, None
    result = rule(req)
    return (body, None) if result.body is req else (json.dumps(result.body).encode(), result.warning())


class SetAsideMiddleware:
    """ASGI: a POST to one of RULES' paths is read whole, what it asks that
    no local model can use is taken out, and the answer (whatever its
    status) carries the warning header naming it."""

    MAX_BODY = 64 << 20  # larger bodies pass untouched: the routes refuse them

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in RULES:
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was whole
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.MAX_BODY:
                break
        original = body = b"".join(chunks)
        warning = None
        if not more:
            body, warning = set_aside_body(scope["path"], body)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": more}
            return await receive()

        if body is not original:
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        if warning is None:
            await self.app(scope, replay, send)
            return

        async def send_with_warning(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (WARNING_HEADER.encode(), warning.encode("latin-1", "replace"))]}
            await send(message)

        await self.app(scope, replay, send_with_warning)
