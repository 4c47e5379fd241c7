"""Malformed tool calls seen in the field, repaired before they are given up
as text (pure; engine/model/tool_calls.py applies them).

Two kinds, each a small named function of the call's body:

- `NORMALIZATIONS`, applied to every body before its parser reads it, as
  they cannot change a well-formed call: a closing tag written twice
  (Qwen3.6's `</parameter>\\n</parameter>`), tags in a namespace
  (`<minimax:invoke ...>`, MiniMax-M3's `]<]minimax[>[<invoke ...>`), a
  closing tag cut off at the end of the stream (`...}</tool_ca`);
- `RECOVERIES`, tried one by one only where the parser fails or returns no
  sensible call: the closing tags or brackets of a call cut at the end of
  the stream, a body with text after its JSON (the text is kept as
  content), a call of LongCat's that names its function and gives no
  arguments.

Each repair returns (body, text left over) or None where it does not apply;
what was repaired is logged by name, so a recovered call is never silent.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

Repair = Callable[[str], "tuple[str, str] | None"]

# The tags of a call's structure (never a value's): a duplicate of one of these closing tags is a model's slip.
STRUCTURE_TAGS = ("parameter", "function", "invoke", "arg_key", "arg_value", "longcat_arg_key", "longcat_arg_value")
_TAGS = "|".join(STRUCTURE_TAGS)
_DUPLICATE_CLOSE = re.compile(rf"(</({_TAGS})>)(?:\s*</\2>)+")
_NAMESPACED = re.compile(rf"<(/?)[A-Za-z_][\w-]*:(?=(?:{_TAGS}|tool_call)\b)")
_NAMESPACE_TOKEN = re.compile(r"\]<\][A-Za-z_][\w-]*\[>\[")  # MiniMax-M3's `]<]minimax[>[` before each tag
_CUT_TAG = re.compile(r"\s*<(?:/[\w:|-]*|\|[\w:-]*\|?|/?)$")  # a tag that the end of the stream cut in two


def duplicated_closing_tag(body: str) -> tuple[str, str] | None:
    fixed = _DUPLICATE_CLOSE.sub(r"\1", body)
    return (fixed, "") if fixed != body else None


def namespaced_tags(body: str) -> tuple[str, str] | None:
    fixed = _NAMESPACED.sub(r"<\1", _NAMESPACE_TOKEN.sub("", body))
    return (fixed, "") if fixed != body else None


def cut_closing_tag(body: str) -> tuple[str, str] | None:
    match = _CUT_TAG.search(body)
    if not match or match.start() == 0:
        return None
    return body[:match.start()], ""


NORMALIZATIONS: tuple[tuple[str, Repair], ...] = (
    ("duplicated closing tag", duplicated_closing_tag),
    ("namespaced tags", namespaced_tags),
    ("closing tag cut off", cut_closing_tag),
)

# Open and closing tags of the tag formats, innermost first: a cut call gets the closing tags it lacks.
TAG_PAIRS = (("<parameter", "</parameter>"), ("<longcat_arg_value>", "</longcat_arg_value>"),
             ("<arg_value>", "</arg_value>"), ("<|tool_call_begin|>", "<|tool_call_end|>"),
             ("<invoke", "</invoke>"), ("<function=", "</function>"))
# Where a format writes a newline before a closing tag (Qwen3-Coder's; the others' parsers strip values).
_NEWLINE_BEFORE = {"</parameter>": "\n", "</function>": "\n", "</invoke>": "\n"}


def unclosed_tags(body: str) -> tuple[str, str] | None:
    """A call cut at the end of the stream inside its tags: the closing tags
    it lacks, innermost first (the last value is kept as far as it was written)."""
    closing = ""
    for opening, close in TAG_PAIRS:
        missing = body.count(opening) - body.count(close)
        if missing > 0:
            closing += (_NEWLINE_BEFORE.get(close, "") + close) * missing
    return (body.rstrip() + closing, "") if closing else None


_QUOTES = (('<|"|>', '<|"|>'), ("<escape>", "<escape>"), ('"', '"'), ("'", "'"))
_CLOSE = {"{": "}", "[": "]", "(": ")"}


def unclosed_brackets(body: str) -> tuple[str, str] | None:
    """A call cut at the end of the stream after a whole value: the brackets
    still open, closed (JSON, Gemma's `call:f{...}`, pythonic `[f(...)]`).
    Cut inside a string, the value itself is cut: not repaired."""
    stack: list[str] = []
    i = 0
    while i < len(body):
        for opening, close in _QUOTES:
            if body.startswith(opening, i):
                end = _string_end(body, i + len(opening), close)
                if end < 0:
                    return None
                i = end
                break
        else:
            ch = body[i]
            if ch in _CLOSE:
                stack.append(_CLOSE[ch])
            elif ch in "}])":
                if not stack or stack.pop() != ch:
                    return None
            i += 1
    return (body.rstrip() + "".join(reversed(stack)), "") if stack else None


def _string_end(text: str, start: int, close: str) -> int:
    """The index after the string that starts at `start` (its quote passed), or -1 where it never ends."""
    i = start
    while i < len(text):
        if close in ('"', "'") and text[i] == "\\":
            i += 2
            continue
        if text.startswith(close, i):
            return i + len(close)
        i += 1
    return -1


def text_after_json(body: str) -> tuple[str, str] | None:
    """`{"name": ..., "arguments": {...}} and then some text`: the JSON, and the text kept as content."""
    start = body.find("{")
    if start < 0:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(body, start)
    except json.JSONDecodeError:
        return None
    tail = body[end:]
    return (body[:end], tail) if tail.strip() else None


def name_only(body: str) -> tuple[str, str] | None:
    """A call that only names its function (LongCat's parser needs an
    argument to find the name): as a JSON call without arguments."""
    name = body.strip()
    if not re.fullmatch(r"[^\s<>{}()\[\]\"']+", name):
        return None
    return json.dumps({"name": name, "arguments": {}}), ""


RECOVERIES: tuple[tuple[str, Repair], ...] = (
    ("call cut at the end of the stream (tags closed)", unclosed_tags),
    ("call cut at the end of the stream (brackets closed)", unclosed_brackets),
    ("text after the call's JSON", text_after_json),
    ("a function named without arguments", name_only),
)


def sensible_calls(parsed: Any) -> list[dict[str, Any]] | None:
    """The parser's result as a list of calls, or None where it holds no
    sensible call (a name with spaces or tags in it, arguments that are
    neither an object nor JSON text): such a result is as good as a failed parse."""
    calls = parsed if isinstance(parsed, list) else [parsed]
    if not calls:
        return None
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        if not re.fullmatch(r"[^\s<>]+", call["name"]):
            return None
        args = call.get("arguments", {})
        if args is not None and not isinstance(args, (dict, str)):
            return None
        if isinstance(args, str) and not _json_object_text(args):  # Kimi's parser hands back what is not JSON
            return None
    return calls


def _json_object_text(text: str) -> bool:
    """Whether `text` is JSON, or a JSON object with text after it (`arguments_object` keeps the object)."""
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return text.lstrip().startswith("{") and text_after_json(text) is not None


def arguments_object(arguments: Any) -> tuple[Any, str, bool]:
    """(the arguments, text that followed them, whether that was repaired):
    arguments given as a string are read as JSON where they are an object
    followed by text (Kimi's parser hands back `{"a": 1} and so on` as a
    string); other strings stand as they are."""
    if not isinstance(arguments, str):
        return arguments, "", False
    try:
        json.loads(arguments)
        return arguments, "", False
    except json.JSONDecodeError:
        pass
    repaired = text_after_json(arguments)
    if repaired is None or not arguments.lstrip().startswith("{"):
        return arguments, "", False
    return json.loads(repaired[0]), repaired[1], True
