import json

import pytest

from mlxd.engine.tool_calls import ToolCallSplitter, format_tool_calls


def parse_json(text, tools=None):
    return json.loads(text.strip())


@pytest.mark.parametrize("pieces, text, bodies", [
    (["hello ", "world"], "hello world", []),
    (['<tool_call>{"name": "f"}</tool_call>'], "", ['{"name": "f"}']),
    (["ok <tool", "_call>", '{"name":', ' "f"}</tool', "_call> done"], "ok  done", ['{"name": "f"}']),
    (["a <tool_c", "x"], "a <tool_cx", []),                          # a false start is released
    (['<tool_call>{"name": "f"}', "<", "/tool_call><tool_call>{}</tool_call>"], "", ['{"name": "f"}', "{}"]),
    (['<tool_call>{"name": "f", "arguments": {'], "", ['{"name": "f", "arguments": {']),  # unterminated
])
def test_splitter(pieces, text, bodies):
    s = ToolCallSplitter("<tool_call>", "</tool_call>")
    out_text, out_bodies = "", []
    for p in pieces:
        t, b = s.feed(p)
        out_text += t
        out_bodies += b
    t, b = s.flush()
    assert (out_text + t, out_bodies + b) == (text, bodies)


def test_format_tool_calls_in_openai_shape_and_keeps_unparsed_text():
    calls, leftover = format_tool_calls(['{"name": "get_weather", "arguments": {"city": "Paris"}}', "{broken"],
                                        parse_json, None)
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert leftover == "{broken"
