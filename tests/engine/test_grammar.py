"""What binds an answer (engine/model/grammar.py), mlxd's tool rendering
(engine/model/tool_prompt.py) and the request fields behind them: pure tables.
Grammars are checked with llguidance on a byte-level tokenizer (one token a
byte), so every text can be fed as it is written."""

from __future__ import annotations

import json

import llguidance
import pytest
from pydantic import ValidationError

from mlxd.api_errors import INVALID_REQUEST, UNSUPPORTED_PARAMETER
from mlxd.engine.model.answer_grammar import answer_grammar
from mlxd.engine.model.grammar import (ANY_OBJECT, MAX_PARALLEL_CALLS, GrammarUnsupported, OutputRules, ToolSpec,
                                       closed, grammar_problem, schema_problem)
from mlxd.engine.model.tool_formats import MLXD_TOOL_FORMAT, ToolFormat, tool_format_of
from mlxd.engine.api.request_schema import ChatCompletionRequest, describe_validation_errors
from mlxd.engine.model.tool_prompt import with_rendered_tools
import testkit

EOS = 256


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = {b: c for b, c in zip(range(256), testkit.byte_level_chars())}
    vocab = {c: b for b, c in alphabet.items()} | {"<eos>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    assert len(ByteLevel.alphabet()) == 256
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=EOS + 1, eos_token=EOS)


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
    ("mlx_lm.tool_parsers.mistral", "[TOOL_CALLS]", "", True,  # no end marker: a call runs to the end
     ToolFormat("[TOOL_CALLS]", "", "template", "mistral")),
    ("mlx_lm.tool_parsers.glm47", "<tool_call>", "</tool_call>", True,
     ToolFormat("<tool_call>", "</tool_call>", "template", "glm")),
    ("mlx_lm.tool_parsers.json_tools", "<tool_call>", "", True, None),  # a format with an end marker needs it
    ("mlx_lm.tool_parsers.kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", True,
     ToolFormat("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "template", "kimi")),
    ("mlx_lm.tool_parsers.minicpm5", "<function", "</function>", True, None),  # a format not bound yet
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


# Mistral's and GLM's formats, bound where mlx-lm's mistral and glm47 parsers read them.
MISTRAL = ToolFormat("[TOOL_CALLS]", "", "template", "mistral")
GLM = ToolFormat("<tool_call>", "</tool_call>", "template", "glm")
PARSERS = {"mistral": "mlx_lm.tool_parsers.mistral", "glm": "mlx_lm.tool_parsers.glm47"}


def mistral_call(name: str, arguments: dict) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}"


def glm_call(name: str, arguments: dict[str, str], newlines: bool = False) -> str:
    """GLM-4.7's call (GLM-4.5's with `newlines`); values as written (raw strings, JSON otherwise)."""
    nl = "\n" if newlines else ""
    pairs = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in arguments.items())
    return f"<tool_call>{name}{nl}{pairs}</tool_call>"


REQUIRED = OutputRules(tool_choice="required", tools=(WEATHER, ADD))
ONE_CALL = OutputRules(tool_choice="required", tools=(WEATHER, ADD), parallel_tool_calls=False)
NAMED = OutputRules(tool_choice="forecast", tools=(FORECAST, WEATHER))
STRICT = OutputRules(tools=(WEATHER, ADD))  # ADD is strict: "auto" binds its calls


@pytest.mark.parametrize("rules, text, ok", [
    (REQUIRED, mistral_call("get_weather", {"city": "Paris"}), True),  # the parser's header form
    (REQUIRED, mistral_call("add", {"a": 1}) + mistral_call("add", {"a": 2}), True),  # several, back to back
    (REQUIRED, mistral_call("add", {"a": 1}) + "\n" + mistral_call("add", {"a": 2}), False),  # no separators
    (REQUIRED, mistral_call("add", {"a": 1}) + "\n", False),  # nothing after a call: it runs to the end
    (REQUIRED, mistral_call("add", {"a": "one"}), False),
    (REQUIRED, mistral_call("get_weather", {"town": "Paris"}), False),
    (REQUIRED, mistral_call("delete_all", {}), False),
    (REQUIRED, "[TOOL_CALLS]get_weather {\"city\": \"Paris\"}", False),  # no [ARGS]
    (REQUIRED, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', False),  # the older JSON-list form
    (REQUIRED, "It is sunny.", False),
    (REQUIRED, "\n".join([mistral_call("add", {"a": 1})] * (MAX_PARALLEL_CALLS + 1)), False),  # capped
    (ONE_CALL, mistral_call("add", {"a": 1}) + mistral_call("add", {"a": 2}), False),
    (OutputRules(tool_choice="add", tools=(WEATHER, ADD)), mistral_call("get_weather", {"city": "Oslo"}), False),
    (STRICT, "Hello there.", True),
    (STRICT, "Let me add. " + mistral_call("add", {"a": 2}), True),
    (STRICT, "Let me add. " + mistral_call("add", {"a": "two"}), False),
    (STRICT, mistral_call("add", {"a": 2}) + " Done.", False),  # text after a call would be read as the call
])
def test_mistral_calls_are_bound_in_its_header_format(byte_tokenizer, rules, text, ok):
    assert accepts(byte_tokenizer, answer_grammar(rules, MISTRAL), text) is ok


@pytest.mark.parametrize("rules, text, ok", [
    (NAMED, glm_call("forecast", {"city": "New York", "days": "3"}), True),  # GLM-4.7's form
    (NAMED, glm_call("forecast", {"city": "Oslo", "days": "3", "unit": "F"}, newlines=True), True),  # GLM-4.5's
    (NAMED, glm_call("forecast", {"city": "New\nYork", "days": "3", "unit": "C", "hourly": "true"}), True),
    (NAMED, glm_call("forecast", {"city": "Oslo"}), False),  # a required argument missing
    (NAMED, glm_call("forecast", {"city": "Oslo", "days": "three"}), False),  # not JSON of an integer
    (NAMED, glm_call("forecast", {"city": "Oslo", "days": '"3"'}), False),  # a JSON string for an integer
    (NAMED, glm_call("forecast", {"city": "Oslo", "days": "3", "unit": "K"}), False),  # not in the enum
    (NAMED, glm_call("forecast", {"city": "Oslo", "days": "3", "wind": "1"}), False),  # no such argument
    (NAMED, glm_call("forecast", {"days": "3", "city": "Oslo"}), False),  # bound in the schema's order
    (NAMED, glm_call("get_weather", {"city": "Oslo"}), False),  # not the named tool
    (NAMED, '<tool_call>{"name": "forecast", "arguments": {"city": "Oslo", "days": 3}}</tool_call>', False),
    (REQUIRED, glm_call("add", {"a": "1"}) + glm_call("get_weather", {"city": "Rome"}), True),  # back to back
    (REQUIRED, glm_call("add", {"a": "1"}) + "\n" + glm_call("add", {"a": "2"}) + "\n", True),  # or a newline
    (ONE_CALL, glm_call("add", {"a": "1"}) + glm_call("add", {"a": "2"}), False),
    (STRICT, "Let me add. " + glm_call("add", {"a": "2"}) + " Done.", True),
    (STRICT, "Let me add. " + glm_call("add", {"a": "two"}), False),
])
def test_glm_calls_are_bound_in_its_arg_key_format(byte_tokenizer, rules, text, ok):
    assert accepts(byte_tokenizer, answer_grammar(rules, GLM), text) is ok


@pytest.mark.parametrize("fmt", [MISTRAL, GLM])
@pytest.mark.parametrize("rules", [REQUIRED, ONE_CALL, NAMED, STRICT, OutputRules(schema=PERSON, tools=(WEATHER,))])
def test_llguidance_compiles_the_new_formats(fmt, rules):
    assert grammar_problem(answer_grammar(rules, fmt)) is None


def test_a_name_the_parser_would_misread_cannot_be_bound():
    dotted = ToolSpec("weather.get", WEATHER.parameters)  # Mistral's parser reads `get` as the name
    with pytest.raises(GrammarUnsupported, match="weather.get"):
        answer_grammar(OutputRules(tool_choice="required", tools=(dotted,)), MISTRAL)
    spaced = ToolSpec("get weather", {"type": "object"})  # GLM's splits a call without arguments at the space
    with pytest.raises(GrammarUnsupported, match="get weather"):
        answer_grammar(OutputRules(tool_choice="required", tools=(spaced,)), GLM)


# The markers as special tokens, as in the models' vocabularies ([TOOL_CALLS] and [ARGS] are control tokens in
# Mistral's tekken, GLM's tags added tokens): the grammar names them by id (engine/model/constrained.py's marker_literal).
SPECIALS = ("[TOOL_CALLS]", "[ARGS]", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>")


class _Encoder:
    """The part of mlx-lm's tokenizer that marker_literal reads."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids


@pytest.fixture(scope="module")
def marker_tokenizer():
    """(llguidance's tokenizer, the tokenizer): bytes, <eos> and the markers as special tokens after them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(testkit.byte_level_chars())} | {"<eos>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<eos>",) + SPECIALS])
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=EOS + 1 + len(SPECIALS), eos_token=EOS), tok


# What a model falls back on where the mask takes its own token away: the end, a marker, then what closes JSON
FALLBACK = [EOS, *range(EOS + 1, EOS + 1 + len(SPECIALS)), *b'"}]:,1']


def steered(marker_tokenizer, grammar: str, wish: str, max_tokens: int = 300) -> str:
    """The text a model that wants to write `wish` writes under the grammar (testkit.steered)."""
    ll, tok = marker_tokenizer
    return testkit.steered(ll, tok, grammar, wish, FALLBACK, EOS, max_tokens)


def read_back(text: str, fmt: ToolFormat, tools: tuple[ToolSpec, ...]) -> tuple[list[dict], str]:
    """(the calls, the content) as mlxd reads the answer: split at the markers
    (engine/model/answer_parts.py), each call parsed by the model's own mlx-lm parser."""
    import importlib

    from mlxd.engine.model.answer_parts import AnswerSplitter, Markers
    from mlxd.engine.model.tool_calls import format_tool_calls

    splitter = AnswerSplitter(Markers(None, (fmt.start, fmt.end or None)))
    parts = splitter.feed(text) + splitter.flush()
    parser = importlib.import_module(PARSERS[fmt.body]).parse_tool_call
    openai_tools = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in tools]
    calls, unparsed = format_tool_calls([p.text for p in parts if p.kind == "tool"], parser, openai_tools)
    assert unparsed == "", text
    return calls, "".join(p.text for p in parts if p.kind == "content")


ALL = (WEATHER, ADD, FORECAST)


@pytest.mark.parametrize("fmt", [MISTRAL, GLM])
@pytest.mark.parametrize("rules, wish, names, content", [
    # "required": a model that would rather answer in text still calls a tool
    (OutputRules(tool_choice="required", tools=ALL), "It is sunny in Paris.", None, ""),
    (OutputRules(tool_choice="required", tools=ALL), "both", ["get_weather", "add"], ""),
    # a named function: the model's other choice of tool and argument types give way
    (OutputRules(tool_choice="forecast", tools=ALL), "get_weather", ["forecast"], ""),
    (OutputRules(tool_choice="forecast", tools=ALL), "forecast", ["forecast"], ""),
    # parallel_tool_calls false: at most one call
    (OutputRules(tool_choice="required", tools=ALL, parallel_tool_calls=False), "both", ["get_weather"], ""),
    # a strict tool under "auto": text, then a call bound to its schema
    (OutputRules(tools=ALL), "Let me add. add", ["add"], "Let me add. "),
    (OutputRules(tools=ALL), "No tool needed.", [], "No tool needed."),
])
def test_a_bound_call_reads_back_with_the_models_parser(marker_tokenizer, fmt, rules, wish, names, content):
    """Text written under the grammar is what mlx-lm's own parser turns into
    a call of an allowed tool with arguments valid against its schema."""
    import jsonschema

    from mlxd.engine.model.constrained import marker_literal

    grammar = answer_grammar(rules, fmt, literal=marker_literal(marker_tokenizer[0], _Encoder(marker_tokenizer[1])))
    assert "<[" in grammar and '""' not in grammar  # markers by id; no end marker is written where there is none
    text = steered(marker_tokenizer, grammar, WISHES[fmt.body].get(wish, wish))
    calls, said = read_back(text, fmt, rules.tools)
    allowed = {t.name: t for t in rules.forced_tools()}
    assert calls or names == [], text
    if names is not None:
        assert [c["function"]["name"] for c in calls] == names, text
    for c in calls:
        tool = allowed[c["function"]["name"]]
        jsonschema.validate(json.loads(c["function"]["arguments"]), tool.parameters)
    assert said.strip() == content.strip(), text  # a newline between calls is text


# What a model wants to write in each format (before the grammar): a wish's name, or the wish itself.
WISHES = {
    "mistral": {
        "both": mistral_call("get_weather", {"city": "Paris"}) + mistral_call("add", {"a": 2}),
        "get_weather": mistral_call("get_weather", {"city": "Oslo", "days": "3"}),
        "forecast": mistral_call("forecast", {"city": "New\nYork", "days": "three", "unit": "K", "hourly": True}),
        "Let me add. add": "Let me add. " + mistral_call("add", {"a": "two"}) + " Done.",
    },
    "glm": {
        "both": glm_call("get_weather", {"city": "Paris"}) + "\n" + glm_call("add", {"a": "2"}),
        "get_weather": glm_call("get_weather", {"city": "Oslo", "days": "3"}),
        "forecast": glm_call("forecast", {"city": "New\nYork", "days": "three", "unit": "K", "hourly": "true"},
                             newlines=True),
        "Let me add. add": "Let me add. " + glm_call("add", {"a": "two"}) + " Done.",
    },
}


@pytest.mark.parametrize("value, ok", [("New York", True), ("a</arg_value>b", False)])
def test_a_glm_string_never_spells_its_closing_tag(marker_tokenizer, value, ok):
    """Where `</arg_value>` is a special token, a value's text may not spell
    it in plain bytes either: the parser would cut the value there."""
    from mlxd.engine.model.constrained import marker_literal

    ll, tok = marker_tokenizer
    grammar = answer_grammar(OutputRules(tool_choice="get_weather", tools=(WEATHER,)), GLM,
                             literal=marker_literal(ll, _Encoder(tok)))
    ids = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    tokens = ids("<tool_call>get_weather<arg_key>city</arg_key><arg_value>") + list(value.encode()) + \
        ids("</arg_value></tool_call>")
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert (matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()) is ok


@pytest.mark.parametrize("proposal, kept", [
    ('{"name": "Al', '{"name": "Al'),        # all allowed: kept whole
    ('{"nope": 1', '{"n'),                  # cut where the grammar stops allowing it ("no" is not a key)
    ('["x"]', ''),                          # not allowed from the first token: nothing to verify
])
def test_prompt_lookups_proposals_are_cut_where_the_grammar_stops_allowing_them(byte_tokenizer, proposal, kept):
    """engine/model/constrained.py's helpers for speculative decoding: the
    longest allowed prefix, the mask before each of its tokens and after the
    last, the matcher left where it was; the tokens the grammar forces."""
    from mlxd.engine.model.constrained import GrammarProcessor

    g = GrammarProcessor(byte_tokenizer, 'start: %json ' + json.dumps(PERSON), EOS + 1, [EOS])
    tokens = byte_tokenizer.tokenize_str(proposal)
    before = g.allowed()
    got, masks = g.masks_along(tokens)
    assert byte_tokenizer.decode_str(got) == kept and len(masks) == len(got) + 1
    assert all(m[t] for m, t in zip(masks, got))  # each kept token allowed by the mask before it
    assert (g.allowed() == before).all()  # rolled back
    if got:
        assert not (masks[1] == masks[0]).all()  # the mask moves along the proposal
    for t in got:
        g.advance(t)
    assert (g.allowed() == masks[-1]).all() and not g.failed


def test_the_tokens_a_grammar_forces_are_proposed_first(byte_tokenizer):
    from mlxd.engine.model.constrained import GrammarProcessor

    g = GrammarProcessor(byte_tokenizer, 'start: %json ' + json.dumps(PERSON), EOS + 1, [EOS])
    assert byte_tokenizer.decode_str(g.forced(8)) == '{'  # an object (whitespace may follow its brace)
    for t in byte_tokenizer.tokenize_str('{"name": "Al", "a'):
        g.advance(t)
    forced = byte_tokenizer.decode_str(g.forced(20))
    assert forced.startswith('ge"'), forced  # the one key left that starts so: the rest of it is forced
    assert g.forced(2) == g.forced(20)[:2]
