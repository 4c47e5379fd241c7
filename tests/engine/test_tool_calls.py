import json

from mlxd.engine.model.tool_calls import format_tool_calls


def parse_json(text, tools=None):
    return json.loads(text.strip())


def test_format_tool_calls_in_openai_shape_and_keeps_unparsed_text():
    calls, leftover = format_tool_calls(['{"name": "get_weather", "arguments": {"city": "Paris"}}', "{broken"],
                                        parse_json, None)
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert leftover == "{broken"
