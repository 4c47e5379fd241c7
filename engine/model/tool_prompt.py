"""Tools for a model whose chat template drops them.

Many small models' templates (the default model's among them) render
`messages` only: a request's `tools` never reach the model, and a chat with
and without them is the same prompt. Where the template does not render
tools (`template_renders`, checked once when the model loads), mlxd renders
them itself in one documented format — the Hermes / Qwen format, which
most instruction-tuned models have seen and mlx-lm's json_tools parser reads
back:

- the tools, as JSON lines between `<tools>` tags, with the instruction to
  answer a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  at the end of the system message (a system message is added when there is none);
- an assistant message's earlier `tool_calls`, as those blocks in its content;
- tool results, as a user message of `<tool_response>` blocks (consecutive
  results in one message).

The rendering is pure (`with_rendered_tools`); docs/AGENTS.md shows it.
"""

from __future__ import annotations

import json
from typing import Any

from .tool_formats import MLXD_TOOL_FORMAT, ToolFormat, tool_format_of
from .harmony import CALL_END, CALL_START, HARMONY_PARSER, is_harmony

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
PROBE_NAME = "mlxd_probe_tool_7f3a"


def template_renders(tokenizer: Any) -> tuple[bool, bool]:
    """(tools, tool calls): whether the chat template renders a request's
    tools, and an assistant message's tool calls. False where it cannot tell."""
    tool = {"type": "function", "function": {"name": PROBE_NAME, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": PROBE_NAME, "arguments": {}}}]}
    try:
        with_tools = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[tool],
                                                   add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that rejects tools does not render them
        with_tools = ""
    try:
        with_call = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, call,
                                                   {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
                                                  add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001
        with_call = ""
    return PROBE_NAME in with_tools, PROBE_NAME in with_call


def tool_support(tokenizer: Any) -> tuple[bool, ToolFormat | None]:
    """(whether the template renders tools, the tool-call format a grammar
    can bind) for a model's tokenizer (mlx-lm's wrapper)."""
    renders, _ = template_renders(tokenizer) if getattr(tokenizer, "chat_template", None) else (False, False)
    if is_harmony(tokenizer):  # gpt-oss: mlx-lm has no parser for it (engine/model/harmony.py)
        return renders, tool_format_of(HARMONY_PARSER, CALL_START, CALL_END, renders)
    parser = getattr(tokenizer, "tool_parser", None)
    return renders, tool_format_of(getattr(parser, "__module__", None), getattr(tokenizer, "tool_call_start", None),
                                   getattr(tokenizer, "tool_call_end", None), renders)


def tool_call_block(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{MLXD_TOOL_FORMAT.start}\n{body}\n{MLXD_TOOL_FORMAT.end}"


def with_rendered_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` (in chat-template form) with the tools, earlier calls and
    tool results written into their text (pure)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            blocks = [tool_call_block(c["function"]["name"], c["function"].get("arguments", {}))
                      for c in m["tool_calls"]]
            text = m.get("content") or ""
            out.append({k: v for k, v in m.items() if k != "tool_calls"}
                       | {"content": "\n".join(([text] if text else []) + blocks)})
        elif role == "tool":
            block = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1] = out[-1] | {"content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        listing = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = out[0] | {"content": f"{out[0]['content']}\n\n{listing}" if out[0]["content"] else listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
