"""What binds an answer (engine/grammar.py), mlxd's tool rendering
(engine/tool_prompt.py) and the request fields behind them: pure tables.
Grammars are checked with llguidance on a byte-level tokenizer (one token a
byte), so every text can be fed as it is written."""

from __future__ import annotations

import json

import llguidance
import pytest
from pydantic import ValidationError

from mlxd.api_errors import INVALID_REQUEST, UNSUPPORTED_PARAMETER
from mlxd.engine.grammar import (ANY_OBJECT, MAX_PARALLEL_CALLS, MLXD_TOOL_FORMAT, GrammarUnsupported, OutputRules,
                                 ToolFormat, ToolSpec, answer_grammar, closed, grammar_problem, schema_problem,
                                 tool_format_of)
from mlxd.engine.request_schema import ChatCompletionRequest, describe_validation_errors
from mlxd.engine.tool_prompt import with_rendered_tools

EOS = 256


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = {b: c for b, c in zip(range(256), _byte_chars())}
    vocab = {c: b for b, c in alphabet.items()} | {"<eos>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    assert len(ByteLevel.alphabet()) == 256
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=EOS + 1, eos_token=EOS)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (as the byte-level BPE writes them)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there."""
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    tokens = tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
ADD = ToolSpec("add", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, strict=True)
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.parametrize("rules, text, ok", [
    (OutputRules(schema=PERSON), '{"name": "Ada", "age": 36}', True),
    (OutputRules(schema=PERSON), '{\n  "name": "Ada",\n  "age": 36\n}', True),  # pretty-printed
    (OutputRules(schema=PERSON), '{"name": "Ada", "age": "36"}', False),  # a string for an integer
    (OutputRules(schema=PERSON), '{"name": "Ada"}', False),  # a required key missing
    (OutputRules(schema=PERSON), '{"name": "Ada", "age": 36, "x": 1}', False),  # additionalProperties false
    (OutputRules(schema=PERSON), 'Sure! {"name": "Ada", "age": 36}', False),  # no text around it
    (OutputRules(schema=PERSON), '{"name": "Ada",' + " " * 40 + '"age": 36}', False),  # whitespace is bounded
    (OutputRules(schema=ANY_OBJECT), '{"anything": [1, 2, {"b": null}]}', True),
    (OutputRules(schema=ANY_OBJECT), '[1, 2]', False),
    (OutputRules(tool_choice="required", tools=(WEATHER, ADD)), call("get_weather", {"city": "Paris"}), True),
    (OutputRules(tool_choice="required", tools=(WEATHER, ADD)), call("add", {"a": 1}), True),
    (OutputRules(tool_choice="required", tools=(WEATHER, ADD)), call("add", {"a": "one"}), False),
    (OutputRules(tool_choice="required", tools=(WEATHER, ADD)), call("get_weather", {"town": "Paris"}), False),
    (OutputRules(tool_choice="required", tools=(WEATHER, ADD)), call("delete_all", {}), False),
    (OutputRules(tool_choice="required", tools=(WEATHER, ADD)), "It is sunny.", False),
    (OutputRules(tool_choice="required", tools=(WEATHER, ADD)),
     call("add", {"a": 1}) + "\n" + call("add", {"a": 2}) + "\n", True),  # parallel, a newline may end it
    (OutputRules(tool_choice="required", tools=(WEATHER,)),
     "\n".join([call("get_weather", {"city": "X"})] * (MAX_PARALLEL_CALLS + 1)), False),  # capped
    (OutputRules(tool_choice="required", tools=(WEATHER, ADD), parallel_tool_calls=False),
     call("add", {"a": 1}) + "\n" + call("add", {"a": 2}), False),
    (OutputRules(tool_choice="get_weather", tools=(WEATHER, ADD)), call("get_weather", {"city": "Paris"}), True),
    (OutputRules(tool_choice="get_weather", tools=(WEATHER, ADD)), call("add", {"a": 1}), False),  # not the named one
    (OutputRules(tool_choice="get_weather", tools=(WEATHER, ADD)),
     call("get_weather", {"city": "A"}) + "\n" + call("get_weather", {"city": "B"}), False),  # named: one call
    # strict tools under "auto": free text, or text then a bound call
    (OutputRules(tools=(WEATHER, ADD)), "Hello there.", True),
    (OutputRules(tools=(WEATHER, ADD)), "Let me add. " + call("add", {"a": 2}), True),
    (OutputRules(tools=(WEATHER, ADD)), "Let me add. " + call("add", {"a": "two"}), False),
    # a schema with tools offered: the answer, or a call instead
    (OutputRules(schema=PERSON, tools=(WEATHER,)), call("get_weather", {"city": "Oslo"}), True),
    (OutputRules(schema=PERSON, tools=(WEATHER,)), '{"name": "Ada", "age": 36}', True),
])
def test_what_a_bound_answer_may_be(byte_tokenizer, rules, text, ok):
    assert accepts(byte_tokenizer, answer_grammar(rules, MLXD_TOOL_FORMAT), text) is ok


@pytest.mark.parametrize("rules, fmt", [(OutputRules(), MLXD_TOOL_FORMAT), (OutputRules(tools=(WEATHER,)), MLXD_TOOL_FORMAT),
                                        (OutputRules(tool_choice="none", tools=(ADD,)), None)])
def test_free_answers_have_no_grammar(rules, fmt):
    assert answer_grammar(rules, fmt) is None


@pytest.mark.parametrize("fmt, text, ok", [
    (MLXD_TOOL_FORMAT, "It is sunny, I think.", True),
    (MLXD_TOOL_FORMAT, "Let me check. " + call("get_weather", {"city": "Oslo"}), False),
    (MLXD_TOOL_FORMAT, "a <tool_call", True),  # only the whole marker is out
    (ToolFormat("[TOOL_CALLS]", ""), 'ok [TOOL_CALLS][{"name": "f"}]', False),  # regex characters escaped
    (ToolFormat("[TOOL_CALLS]", ""), "ok [TOOL] CALLS", True),
])
def test_tool_choice_none_never_opens_a_call(byte_tokenizer, fmt, text, ok):
    grammar = answer_grammar(OutputRules(tool_choice="none", tools=(WEATHER,)), fmt)
    assert accepts(byte_tokenizer, grammar, text) is ok


@pytest.mark.parametrize("in_reasoning, think_start, text, ok", [
    (True, None, 'Let me think.\nA person.</think>\n{"name": "Ada", "age": 36}', True),
    (True, None, '{"name": "Ada", "age": 36}', False),  # the prompt opened a block: it must be closed first
    (False, "<think>", '<think>hmm</think>{"name": "Ada", "age": 36}', True),
    (False, "<think>", '{"name": "Ada", "age": 36}', True),  # or no reasoning at all
    (False, "<think>", 'hmm</think>{"name": "Ada", "age": 36}', False),
])
def test_reasoning_comes_first_and_is_free(byte_tokenizer, in_reasoning, think_start, text, ok):
    grammar = answer_grammar(OutputRules(schema=PERSON), None, "</think>", in_reasoning, think_start)
    assert accepts(byte_tokenizer, grammar, text) is ok


def test_a_model_whose_call_format_cannot_be_bound_says_so():
    with pytest.raises(GrammarUnsupported, match="tool-call format"):
        answer_grammar(OutputRules(tool_choice="required", tools=(WEATHER,)), None)
    # a schema alone needs no tool format
    assert answer_grammar(OutputRules(schema=PERSON), None) is not None


@pytest.mark.parametrize("parser, start, end, renders, expected", [
    ("mlx_lm.tool_parsers.json_tools", "<tool_call>", "</tool_call>", True, ToolFormat("<tool_call>", "</tool_call>")),
    ("mlx_lm.tool_parsers.qwen3_coder", "<tool_call>", "</tool_call>", True,
     ToolFormat("<tool_call>", "</tool_call>", "template", "xml")),
    ("mlx_lm.tool_parsers.glm47", "<tool_call>", "</tool_call>", True, None),  # a format not bound yet
    (None, None, None, True, None),  # a template with tools but no parser mlx-lm knows
    (None, None, None, False, MLXD_TOOL_FORMAT),  # the template drops tools: mlxd's own format
    ("mlx_lm.tool_parsers.mistral", "[TOOL_CALLS]", "", False, MLXD_TOOL_FORMAT),
])
def test_which_tool_format_a_grammar_binds(parser, start, end, renders, expected):
    assert tool_format_of(parser, start, end, renders) == expected


@pytest.mark.parametrize("schema, problem", [
    (PERSON, None),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": "number"}}}, None),
    ({"type": "string", "format": "email"}, None),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '"if"'),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"type": "string", "pattern": "^a(?=b)"}, "look-around"),
    ([1, 2], "must be an object"),
])
def test_schema_features_the_engine_cannot_enforce_are_named(schema, problem):
    found = schema_problem(schema)
    assert (found is None) if problem is None else (problem in found)


@pytest.mark.parametrize("lark, problem", [
    ('start: "a"', None),
    ('start: b', "unknown name"),
    ('start: %json {"type": "array", "uniqueItems": true}', "uniqueItems"),
])
def test_a_whole_grammar_is_checked_before_the_worker_needs_it(lark, problem):
    found = grammar_problem(lark)
    assert (found is None) if problem is None else (problem in found)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}


def code_of(body: dict) -> tuple[str, str | None, str]:
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    return describe_validation_errors(caught.value.errors())


@pytest.mark.parametrize("extra, code, param", [
    ({"response_format": {"type": "json_schema"}}, INVALID_REQUEST, "response_format"),
    ({"response_format": {"type": "yaml"}}, INVALID_REQUEST, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                          "uniqueItems": True}}}},
     UNSUPPORTED_PARAMETER, "response_format.json_schema.schema"),
    ({"tool_choice": "required"}, INVALID_REQUEST, None),  # no tools to call
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, INVALID_REQUEST, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": {"type": "object", "if": {}}}}]},
     UNSUPPORTED_PARAMETER, None),
    # with a response schema, a call to any tool may be the answer: its schema is bound too
    ({"response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}]},
     UNSUPPORTED_PARAMETER, None),
])
def test_bad_bindings_are_400s_naming_the_field(extra, code, param):
    message, got_param, got_code = code_of({**CHAT, **extra})
    assert got_code == code and (param is None or got_param == param), message


@pytest.mark.parametrize("extra, rules", [
    ({}, OutputRules()),
    ({"response_format": {"type": "text"}}, OutputRules()),
    ({"response_format": {"type": "json_object"}}, OutputRules(schema=ANY_OBJECT)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
     OutputRules(schema=PERSON)),
    ({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
     OutputRules(tool_choice="required", parallel_tool_calls=False, tools=(WEATHER,))),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     OutputRules(tool_choice="get_weather", tools=(WEATHER,))),
    ({"tools": [TOOL], "tool_choice": "none"}, OutputRules(tool_choice="none", tools=(WEATHER,))),
])
def test_the_request_says_how_its_answer_is_bound(extra, rules):
    assert ChatCompletionRequest.model_validate({**CHAT, **extra}).output_rules() == rules


def test_mlxd_renders_tools_calls_and_results_into_the_messages():
    tools = [TOOL]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo and Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                    {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"},
                {"role": "tool", "tool_call_id": "c2", "content": "sun"}]
    out = with_rendered_tools(messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(TOOL) in out[0]["content"]
    assert out[2]["content"] == call("get_weather", {"city": "Oslo"}) + "\n" + call("get_weather", {"city": "Rome"})
    assert "tool_calls" not in out[2]
    assert out[3]["content"] == "<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n</tool_response>"
    assert messages[2]["tool_calls"]  # the input is not changed
    # no system message: one is added; no tools: none is
    assert with_rendered_tools([{"role": "user", "content": "hi"}], tools)[0]["role"] == "system"
    assert with_rendered_tools([{"role": "user", "content": "hi"}], None) == [{"role": "user", "content": "hi"}]


XML = ToolFormat("<tool_call>", "</tool_call>", "template", "xml")
FORECAST = ToolSpec("forecast", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["C", "F"]},
    "hourly": {"type": "boolean"}}, "required": ["city", "days"]})


def xml_call(name: str, params: dict[str, str]) -> str:
    blocks = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{blocks}</function>\n</tool_call>"


@pytest.mark.parametrize("text, ok", [
    (xml_call("forecast", {"city": "New\nYork", "days": "3"}), True),  # a string is raw text, newlines and all
    (xml_call("forecast", {"city": "Oslo", "days": "3", "unit": "F", "hourly": "true"}), True),
    (xml_call("forecast", {"city": "Oslo"}), False),  # a required argument missing
    (xml_call("forecast", {"city": "Oslo", "days": "three"}), False),  # not an integer
    (xml_call("forecast", {"city": "Oslo", "days": "3", "unit": "K"}), False),  # not in the enum
    (xml_call("forecast", {"city": "Oslo", "days": "3", "wind": "1"}), False),  # no such argument
    (xml_call("get_weather", {"city": "Oslo"}), False),  # not the named tool
    ('<tool_call>\n{"name": "forecast", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>', False),  # JSON body
])
def test_qwen3_coder_calls_are_bound_in_its_xml_format(byte_tokenizer, text, ok):
    grammar = answer_grammar(OutputRules(tool_choice="forecast", tools=(FORECAST, WEATHER)), XML)
    assert accepts(byte_tokenizer, grammar, text) is ok


def test_a_bound_xml_call_reads_back_with_the_models_parser():
    """What the grammar lets through is what mlx-lm's qwen3_coder parser turns into typed arguments."""
    from mlx_lm.tool_parsers.qwen3_coder import parse_tool_call

    tools = [{"type": "function", "function": {"name": FORECAST.name, "parameters": FORECAST.parameters}}]
    body = xml_call("forecast", {"city": "New\nYork", "days": "3", "hourly": "false"})
    body = body.removeprefix("<tool_call>").removesuffix("</tool_call>")
    call = parse_tool_call(body, tools)
    assert call == {"name": "forecast", "arguments": {"city": "New\nYork", "days": 3, "hourly": False}}


@pytest.mark.parametrize("schema, expected", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}},
     {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},  # said: kept
     {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}),
    ({"type": "object"}, {"type": "object"}),  # no properties listed: any object, as json_object asks
    ({"type": "array", "items": {"properties": {"x": {}}}},
     {"type": "array", "items": {"properties": {"x": {}}, "additionalProperties": False}}),
    ({"$defs": {"P": {"properties": {"n": {}}}}, "anyOf": [{"$ref": "#/$defs/P"}, {"properties": {"m": {}}}]},
     {"$defs": {"P": {"properties": {"n": {}}, "additionalProperties": False}},
      "anyOf": [{"$ref": "#/$defs/P"}, {"properties": {"m": {}}, "additionalProperties": False}]}),
    # a property named "properties" is a name, not a schema keyword
    ({"properties": {"properties": {"type": "string"}}},
     {"properties": {"properties": {"type": "string"}}, "additionalProperties": False}),
])
def test_listed_objects_are_closed(schema, expected):
    assert closed(schema) == expected


def test_a_closed_object_takes_no_other_key(byte_tokenizer):
    grammar = answer_grammar(OutputRules(schema={"type": "object", "properties": {"a": {"type": "integer"}}}), None)
    assert accepts(byte_tokenizer, grammar, '{"a": 1}')
    assert not accepts(byte_tokenizer, grammar, '{"a": 1, "b": 2}')
