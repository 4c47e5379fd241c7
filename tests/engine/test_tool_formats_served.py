"""Forced tool calls over HTTP in each family's format, on a real engine: the
demo model (random weights) under a chat template that names the family's
markers, so mlx-lm picks that family's parser (its `_infer_tool_parser`; for
gpt-oss, the harmony template). Whatever the random model would write, a
forced call comes back a valid call (its arguments are enums and booleans:
a random model's free text, and its digits, never end) (engine/model/call_grammars.py,
engine/model/harmony.py). The markers are text in the demo vocabulary
(tests/engine/test_tool_formats.py covers them as special tokens)."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from openai import OpenAI

from conftest import engine_toml, running_engine

pytestmark = pytest.mark.timeout(400)

# What each family's template says, enough for mlx-lm to infer its parser (and, for harmony, its channels).
FAMILY_MARKERS = {
    "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|>",
    "gemma4": '<|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>',
    "function-gemma": "<start_function_call>call:NAME{key:<escape>text<escape>}<end_function_call>",
    "pythonic": "<|tool_call_start|>[NAME(key=value)]<|tool_call_end|>",
    "minimax": '<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="key">value</parameter>\n</invoke>\n'
               "</minimax:tool_call>",
    "longcat": "<longcat_tool_call>NAME\n<longcat_arg_key>key</longcat_arg_key>\n<longcat_arg_value>value"
               "</longcat_arg_value>\n</longcat_tool_call>",
    "harmony": "<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{}<|call|>",
}


def template(family: str) -> str:
    opening = "<|start|>assistant" if family == "harmony" else "assistant: "
    return ("{%- if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\nCall one as "
            + FAMILY_MARKERS[family] + "\n{% endif %}"
            "{%- for m in messages %}{{ m.role }}: {{ m.content or '' }}\n{% endfor %}"
            "{%- if add_generation_prompt %}" + opening + "{% endif %}")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]},
                                                    "hourly": {"type": "boolean"}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
                   "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def client(tmp_path_factory, demo_models):
    root = tmp_path_factory.mktemp("families")
    extra = {}
    for family in FAMILY_MARKERS:
        folder = root / family
        shutil.copytree(demo_models.a, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template(family)}))
        extra[f"demo-{family}"] = {"path": folder}
    with running_engine(tmp_path_factory, engine_toml(demo_models, {"max_tokens_cap": 256},
                                                      extra_models=extra)) as ep:
        yield OpenAI(base_url=ep.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("family", list(FAMILY_MARKERS))
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_a_forced_call_is_a_valid_call(client, family, tool_choice):
    answer = client.chat.completions.create(
        model=f"demo-{family}", messages=[{"role": "user", "content": "Tell me a joke."}], tools=[WEATHER, TIME],
        tool_choice=tool_choice, max_tokens=256, temperature=0,
        parallel_tool_calls=False)  # one call: a random model would call again until max_tokens
    message = answer.choices[0].message
    assert message.tool_calls, message
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_time"]
    assert answer.choices[0].finish_reason == "tool_calls"
    assert not (message.content or "").strip(), message
