"""Every tool-call format mlxd binds and parses beyond the first four: Kimi K2,
Gemma 4, FunctionGemma, pythonic (LFM2), MiniMax M2, LongCat
(engine/model/call_grammars.py) and gpt-oss's harmony (engine/model/harmony.py);
and the lenient reading of malformed calls (engine/model/call_repair.py).
Pure tables, no model: answers as the models write them are split and parsed
as mlxd does; grammars are checked with llguidance on a byte-level tokenizer,
the markers as special tokens where the grammar must name them by id."""

from __future__ import annotations

import importlib
import json
import logging

import jsonschema
import llguidance
import pytest

from mlxd.engine.model.answer_parts import AnswerSplitter, Markers, Part
from mlxd.engine.model.answer_grammar import answer_grammar
from mlxd.engine.model.grammar import MAX_PARALLEL_CALLS, GrammarUnsupported, OutputRules, ToolSpec, grammar_problem
from mlxd.engine.model.tool_formats import ToolFormat, tool_format_of
from mlxd.engine.model.harmony import CALL_END, CALL_START, HARMONY_PARSER, harmony_edges
from mlxd.engine.model.tool_calls import format_tool_calls, model_parser
import testkit

PARSERS = {"kimi": "mlx_lm.tool_parsers.kimi_k2", "gemma4": "mlx_lm.tool_parsers.gemma4",
           "function_gemma": "mlx_lm.tool_parsers.function_gemma", "pythonic": "mlx_lm.tool_parsers.pythonic",
           "minimax": "mlx_lm.tool_parsers.minimax_m2", "longcat": "mlx_lm.tool_parsers.longcat",
           "harmony": HARMONY_PARSER, "json": "mlx_lm.tool_parsers.json_tools",
           "xml": "mlx_lm.tool_parsers.qwen3_coder", "glm": "mlx_lm.tool_parsers.glm47"}


def fmt_of(body: str) -> ToolFormat:
    """The format tool_format_of gives a model with that mlx-lm parser (its own markers)."""
    module = importlib.import_module(PARSERS[body])
    fmt = tool_format_of(PARSERS[body], module.tool_call_start, module.tool_call_end, True)
    assert fmt is not None and fmt.body == body
    return fmt


def parser_of(body: str):
    if body == "harmony":
        return model_parser(type("Tok", (), {"chat_template": "<|channel|>x<|message|>"})())
    return importlib.import_module(PARSERS[body]).parse_tool_call


WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                                   "days": {"type": "integer"}},
                                   "required": ["city"]})
TIME = ToolSpec("get_time", {"type": "object", "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}},
                             "required": ["tz"]})
ROUTE = ToolSpec("route", {"type": "object", "properties": {
    "to": {"type": "string"}, "fast": {"type": "boolean"}, "stops": {"type": "array", "items": {"type": "string"}},
    "at": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
           "required": ["lat", "lon"]}}, "required": ["to"]})
TOOLS = (WEATHER, TIME, ROUTE)
TODAY = ToolSpec("today", {"type": "object", "properties": {}})  # no arguments
OPENAI_TOOLS = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
                for t in TOOLS + (TODAY,)]


def read(text: str, body: str, pieces: int = 1) -> tuple[list[tuple[str, dict]], str, str]:
    """(the calls as (name, arguments), the content, the reasoning) as mlxd reads an answer in this format:
    split at its markers (in `pieces` chunks, as a stream), each call parsed by the model's parser, leniently."""
    fmt = fmt_of(body)
    markers = Markers(tool=(CALL_START, CALL_END), harmony=True) if body == "harmony" else \
        Markers(("<think>", "</think>"), (fmt.start, fmt.end or None))
    splitter = AnswerSplitter(markers)
    size = max(1, len(text) // pieces)
    parts: list[Part] = []
    for i in range(0, len(text), size):
        parts += splitter.feed(text[i:i + size])
    parts += splitter.flush()
    calls, unparsed = format_tool_calls([p.text for p in parts if p.kind == "tool"], parser_of(body), OPENAI_TOOLS)
    content = "".join(p.text for p in parts if p.kind == "content") + unparsed
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], content, reasoning


PARIS = ("get_weather", {"city": "Paris", "days": 3})
CET = ("get_time", {"tz": "CET"})


# Answers as each family writes them (the forms their mlx-lm parsers document), and what mlxd reads in them.
@pytest.mark.parametrize("body, text, calls, content, reasoning", [
    # Kimi K2: one section, its calls back to back, ids functions.NAME:INDEX
    ("kimi", "I'll look both up.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>'
             'functions.get_time:1<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|>'
             "<|tool_calls_section_end|>", [PARIS, CET], "I'll look both up.", ""),
    ("kimi", "<think>The user wants weather.</think><|tool_calls_section_begin|><|tool_call_begin|>"
             'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
             "<|tool_calls_section_end|>", [PARIS], "", "The user wants weather."),
    # Gemma 4: call:NAME{bare keys, <|"|> strings}, each call in its own markers
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
               '<|tool_call>call:get_time{tz:<|"|>CET<|"|>}<tool_call|>', [PARIS, CET], "", ""),
    ("gemma4", '<|tool_call>call:route{to:<|"|>Lyon, {centre}<|"|>,stops:[<|"|>Dijon<|"|>],at:{lat:45.7,lon:4.8}}'
               "<tool_call|>", [("route", {"to": "Lyon, {centre}", "stops": ["Dijon"],
                                           "at": {"lat": 45.7, "lon": 4.8}})], "", ""),
    # FunctionGemma: call:NAME{key:<escape>text<escape>,n:3}
    ("function_gemma", "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}"
                       "<end_function_call>", [PARIS], "", ""),
    # pythonic (LFM2): a Python list of calls
    ("pythonic", '<|tool_call_start|>[get_weather(city="Paris", days=3), get_time(tz="CET")]<|tool_call_end|>'
                 "Checking both.", [PARIS, CET], "Checking both.", ""),
    ("pythonic", '<|tool_call_start|>[route(to="Lyon", fast=true, at={"lat": 45.7, "lon": 4.8})]<|tool_call_end|>',
     [("route", {"to": "Lyon", "fast": True, "at": {"lat": 45.7, "lon": 4.8}})], "", ""),
    # MiniMax M2: invokes in one block, values as text converted by the tool's schema
    ("minimax", '<think>Two lookups.</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
                '<invoke name="get_time">\n<parameter name="tz">CET</parameter>\n</invoke>\n</minimax:tool_call>',
     [PARIS, CET], "\n\n", "Two lookups."),
    # LongCat: GLM's arg_key form with its own tags
    ("longcat", "<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n<longcat_arg_value>Paris"
                "</longcat_arg_value>\n<longcat_arg_key>days</longcat_arg_key>\n<longcat_arg_value>3"
                "</longcat_arg_value>\n</longcat_tool_call>", [PARIS], "", ""),
    # gpt-oss's harmony: analysis is reasoning, a commentary to a function a call
    ("harmony", "<|channel|>analysis<|message|>User asks weather. Call tool.<|end|><|start|>assistant<|channel|>"
                'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":3}<|call|>',
     [PARIS], "", "User asks weather. Call tool."),
    ("harmony", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
                '<|channel|>commentary json<|message|>{"city":"Paris","days":3}', [PARIS], "", "Need weather."),
    ("harmony", "<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final"
                "<|message|>Hello! How can I help?<|return|>", [], "Hello! How can I help?", "Simple greeting."),
    ("harmony", "<|channel|>commentary<|message|>Checking now.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_time <|constrain|>json<|message|>{"tz":"CET"}', [CET], "Checking now.", ""),
])
@pytest.mark.parametrize("pieces", [1, 7])
def test_each_familys_answers_read_as_calls(body, text, calls, content, reasoning, pieces):
    assert read(text, body, pieces) == (calls, content, reasoning)


# Malformed calls seen in the field: recovered, and the repair logged; what cannot be read stays text.
@pytest.mark.parametrize("body, text, calls, content, repair", [
    ("xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", [PARIS], "", "duplicated closing tag"),
    ("minimax", '<minimax:tool_call>\n<minimax:invoke name="get_weather">\n<minimax:parameter name="city">Paris'
                '</minimax:parameter>\n<minimax:parameter name="days">3</minimax:parameter>\n</minimax:invoke>\n'
                "</minimax:tool_call>", [PARIS], "", "namespaced tags"),
    ("minimax", '<minimax:tool_call>\n]<]minimax[>[<invoke name="get_time">\n]<]minimax[>[<parameter name="tz">CET'
                "]<]minimax[>[</parameter>\n]<]minimax[>[</invoke>\n</minimax:tool_call>", [CET], "",
     "namespaced tags"),
    ("xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3",
     [PARIS], "", "tags closed"),
    ("minimax", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n',
     [("get_weather", {"city": "Paris"})], "", "tags closed"),
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
             '{"tz": "CET"}', [CET], "", "tags closed"),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3', [PARIS], "", "brackets closed"),
    ("pythonic", '<|tool_call_start|>[get_weather(city="Paris", days=3)', [PARIS], "", "brackets closed"),
    ("json", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}\n', [CET], "", "brackets closed"),
    ("json", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_ca', [CET], "",
     "closing tag cut off"),
    ("json", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}} I will wait for it.\n</tool_call>',
     [CET], " I will wait for it.\n", "text after the call's JSON"),
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
             '{"tz": "CET"} now<|tool_call_end|><|tool_calls_section_end|>', [CET], " now",
     "text after the arguments' JSON"),
    ("longcat", "<longcat_tool_call>today\n</longcat_tool_call>", [("today", {})], "",
     "a function named without arguments"),
    ("longcat", "<longcat_tool_call>get_time\n</longcat_tool_call>", [], "get_time\n", None),  # tz is required
    ("pythonic", '<|tool_call_start|>[get_weather(days=3, ', [], '[get_weather(days=3, ', None),  # city cut off
    # not recoverable: given back as the text it was
    ("json", "<tool_call>\nI cannot call that.\n</tool_call>", [], "\nI cannot call that.\n", None),
    ("json", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CE', [], '\n{"name": "get_time", '
     '"arguments": {"tz": "CE', None),  # cut inside a value
    ("longcat", "<longcat_tool_call>delete_everything\n</longcat_tool_call>", [], "delete_everything\n", None),
])
def test_malformed_calls_are_recovered_and_reported(caplog, body, text, calls, content, repair):
    with caplog.at_level(logging.WARNING, logger="mlxd.engine.model.tool_calls"):
        assert read(text, body)[:2] == (calls, content)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert (repair in logged) if repair else "did not parse" in logged


def test_a_well_formed_call_logs_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="mlxd.engine.model.tool_calls"):
        assert read('<|tool_call>call:get_time{tz:<|"|>CET<|"|>}<tool_call|>', "gemma4")[0] == [CET]
    assert not caplog.records


@pytest.mark.parametrize("tools, expected", [
    (True, ("<|channel|>commentary to=", "tool")),
    (False, ("<|channel|>analysis<|message|>", "reasoning")),
])
def test_harmony_channels_are_the_splitters_edges(tools, expected):
    edges = harmony_edges(tools)
    assert expected in edges["normal"]
    markers = [m for m, _ in edges["normal"]]
    # mlx-lm's matcher fires on the first marker that completes: none may end inside another
    assert not any(a != b and a in b and not b.endswith(a) for a in markers for b in markers)


# --- grammars -------------------------------------------------------------------------------------------------

EOS = 256


# The markers, as special tokens in the models' vocabularies.
SPECIALS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_call>", "<tool_call|>", '<|"|>',
            "<start_function_call>", "<end_function_call>", "<escape>", "<|tool_call_start|>",
            "<minimax:tool_call>", "</minimax:tool_call>", "<longcat_tool_call>", "</longcat_tool_call>",
            "<longcat_arg_key>", "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>",
            "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|end|>", "<|start|>", "<|return|>")


def _tokenizer(specials: tuple[str, ...]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(testkit.byte_level_chars())} | {"<eos>": EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<eos>",) + specials])
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=EOS + 1 + len(specials), eos_token=EOS), tok


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Bytes only: every marker is text."""
    return _tokenizer(())


@pytest.fixture(scope="module")
def marker_tokenizer():
    return _tokenizer(SPECIALS)


class _Encoder:
    """The part of mlx-lm's tokenizer that marker_literal reads."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids


def grammar_for(tokenizer, rules: OutputRules, body: str) -> str:
    from mlxd.engine.model.constrained import marker_literal

    return answer_grammar(rules, fmt_of(body), literal=marker_literal(tokenizer[0], _Encoder(tokenizer[1])))


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there."""
    ll, tok = tokenizer
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    tokens = tok.encode(text, add_special_tokens=False).ids
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


GEMMA4_QUOTE = '<|"|>'


# One valid call a format writes, by (name, arguments): how each model writes it.
def _gemma_value(value, quote: str) -> str:
    if isinstance(value, str):
        return f"{quote}{value}{quote}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma_value(v, quote)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_gemma_value(v, quote) for v in value) + "]"
    return json.dumps(value)


WRITERS = {
    "kimi": lambda calls: "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)) + "<|tool_calls_section_end|>",
    "gemma4": lambda calls: "".join(f"<|tool_call>call:{n}{_gemma_value(a, GEMMA4_QUOTE)}<tool_call|>"
                                    for n, a in calls),
    "function_gemma": lambda calls: "".join(
        f"<start_function_call>call:{n}{_gemma_value(a, '<escape>')}<end_function_call>" for n, a in calls),
    "pythonic": lambda calls: "<|tool_call_start|>[" + ", ".join(
        f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) + ")" for n, a in calls) +
        "]<|tool_call_end|>",
    "minimax": lambda calls: "<minimax:tool_call>\n" + "\n".join(
        f'<invoke name="{n}">\n' + "".join(
            f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>\n'
            for k, v in a.items()) + "</invoke>" for n, a in calls) + "\n</minimax:tool_call>",
    "longcat": lambda calls: "".join(
        f"<longcat_tool_call>{n}\n" + "".join(
            f"<longcat_arg_key>{k}</longcat_arg_key>\n<longcat_arg_value>{v if isinstance(v, str) else json.dumps(v)}"
            "</longcat_arg_value>\n" for k, v in a.items()) + "</longcat_tool_call>" for n, a in calls),
    "harmony": lambda calls: "".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}<|call|>"
        for n, a in calls),
}
NEW_FORMATS = list(WRITERS)
HARMONY_THINK = "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant"

REQUIRED = OutputRules(tool_choice="required", tools=TOOLS)
ONE = OutputRules(tool_choice="required", tools=TOOLS, parallel_tool_calls=False)
NAMED = OutputRules(tool_choice="get_time", tools=TOOLS)
ROUTE_CALL = ("route", {"to": "Lyon", "fast": True, "at": {"lat": 45.7, "lon": 4.8}})


def fitting(rules: OutputRules, body: str) -> OutputRules:
    """The rules without the tool that takes objects, for FunctionGemma (whose format holds none)."""
    if body != "function_gemma":
        return rules
    return OutputRules(rules.schema, rules.tool_choice, rules.parallel_tool_calls,
                       tuple(t for t in rules.tools if t is not ROUTE))


@pytest.mark.parametrize("body", NEW_FORMATS)
@pytest.mark.parametrize("rules, calls, ok", [
    (REQUIRED, [PARIS], True),
    (REQUIRED, [("get_weather", {"city": "Paris"})], True),  # an optional argument left out
    (REQUIRED, [CET, PARIS], "parallel"),  # several calls, where the format holds them
    (REQUIRED, [("get_weather", {"city": "Paris", "days": "three"})], False),  # a string for an integer
    (REQUIRED, [("get_weather", {"days": 3})], False),  # a required argument missing
    (REQUIRED, [("get_time", {"tz": "PST"})], False),  # not in the enum
    (REQUIRED, [("get_weather", {"city": "Paris", "wind": 1})], False),  # no such argument
    (REQUIRED, [("delete_all", {})], False),  # no such tool
    (ONE, [CET, PARIS], False),
    (NAMED, [CET], True),
    (NAMED, [PARIS], False),  # not the named tool
    (REQUIRED, [ROUTE_CALL], "objects"),
])
def test_each_format_binds_valid_calls_only(marker_tokenizer, byte_tokenizer, body, rules, calls, ok):
    if ok == "parallel":
        ok = body != "harmony"  # a harmony call ends the turn: one call an answer
    if ok == "objects":
        ok = body != "function_gemma"  # FunctionGemma's parser reads no objects
        if not ok:
            with pytest.raises(GrammarUnsupported, match="FunctionGemma"):
                grammar_for(marker_tokenizer, rules, body)
            return
    rules = fitting(rules, body)
    text = WRITERS[body](calls)
    for tokenizer in (marker_tokenizer, byte_tokenizer):  # markers as special tokens, and as text
        assert accepts(tokenizer, grammar_for(tokenizer, rules, body), text) is ok, (body, text)


@pytest.mark.parametrize("body, text, ok", [
    ("kimi", WRITERS["kimi"]([PARIS]) + WRITERS["kimi"]([CET]), False),  # one section holds them all
    ("gemma4", '<|tool_call>call:get_weather{"city":<|"|>Paris<|"|>}<tool_call|>', False),  # keys are bare
    ("gemma4", '<|tool_call>call:get_weather{city:"Paris"}<tool_call|>', False),  # strings in <|"|>
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Pa<|"|>ris<|"|>}<tool_call|>', False),
    ("function_gemma", "<start_function_call>call:get_weather{city:<escape>Pa}ris<escape>}<end_function_call>",
     False),  # the parser reads to the first }
    ("pythonic", '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>', True),
    ("pythonic", '<|tool_call_start|>[get_weather("Paris")]<|tool_call_end|>', False),  # keywords only
    ("pythonic", '<|tool_call_start|>[get_weather(days=3, city="Paris")]<|tool_call_end|>', False),  # in order
    ("pythonic", '<|tool_call_start|>[get_weather(city="Paris" days=3)]<|tool_call_end|>', False),
    ("minimax", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</invoke>'
                "</parameter>\n</invoke>\n</minimax:tool_call>", False),  # a value may not close the invoke
    ("longcat", "<longcat_tool_call>get_weather<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>Paris"
                "</longcat_arg_value></longcat_tool_call>", True),  # newlines optional, as in GLM-4.7
    ("harmony", HARMONY_THINK + WRITERS["harmony"]([PARIS]), True),  # reasoning first
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}',
     False),  # <|call|> ends it
    ("harmony", "<|channel|>final<|message|>It is sunny.", False),  # "required": no final answer
])
def test_format_details(marker_tokenizer, body, text, ok):
    assert accepts(marker_tokenizer, grammar_for(marker_tokenizer, fitting(REQUIRED, body), body), text) is ok


@pytest.mark.parametrize("rules, text, ok", [
    (OutputRules(schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
     HARMONY_THINK + '<|channel|>final<|message|>{"a": 1}', True),
    (OutputRules(schema={"type": "object"}), '<|channel|>final<|message|>{"a": 1}', True),
    (OutputRules(schema={"type": "object"}), '{"a": 1}', False),  # the final channel's header first
    (OutputRules(schema={"type": "object"}, tools=TOOLS), WRITERS["harmony"]([CET]), True),  # or a call
    (OutputRules(tool_choice="none", tools=TOOLS), "<|channel|>final<|message|>Sunny, 20 degrees.", True),
    (OutputRules(tool_choice="none", tools=TOOLS), WRITERS["harmony"]([CET]), False),
    (OutputRules(tools=(ToolSpec("get_time", TIME.parameters, strict=True),)), WRITERS["harmony"]([CET]), True),
    (OutputRules(tools=(ToolSpec("get_time", TIME.parameters, strict=True),)),
     WRITERS["harmony"]([("get_time", {"tz": "PST"})]), False),
    (OutputRules(tools=(ToolSpec("get_time", TIME.parameters, strict=True),)), "<|channel|>final<|message|>Hi.",
     True),
])
def test_harmony_answers_are_bound_in_their_channels(marker_tokenizer, rules, text, ok):
    assert accepts(marker_tokenizer, grammar_for(marker_tokenizer, rules, "harmony"), text) is ok


@pytest.mark.parametrize("body", NEW_FORMATS)
@pytest.mark.parametrize("rules", [REQUIRED, ONE, NAMED, OutputRules(tools=(ToolSpec("get_time", TIME.parameters,
                                                                                     strict=True), WEATHER)),
                                   OutputRules(schema={"type": "object"}, tools=(WEATHER,)),
                                   OutputRules(tool_choice="none", tools=(WEATHER,))])
def test_llguidance_compiles_every_format(body, rules):
    rules = fitting(rules, body)
    assert grammar_problem(answer_grammar(rules, fmt_of(body))) is None


@pytest.mark.parametrize("body, tool, named", [
    ("pythonic", ToolSpec("get-weather", {"type": "object"}), "get-weather"),  # not a Python name
    ("pythonic", ToolSpec("f", {"type": "object", "properties": {"from": {"type": "string"}}}), "from"),
    ("gemma4", ToolSpec("f", {"type": "object", "properties": {"a b": {"type": "string"}}}), "a b"),
    ("gemma4", ToolSpec("f", {"type": "object", "properties": {"s": {"type": "string", "pattern": "x+"}}}),
     "pattern"),  # a constraint the dialect cannot enforce is named
    ("function_gemma", ToolSpec("f", {"type": "object", "properties": {"l": {"type": "array"}}}), "array"),
    ("minimax", ToolSpec('say"hi', {"type": "object"}), 'say"hi'),
    ("kimi", ToolSpec("get weather", {"type": "object"}), "get weather"),
])
def test_what_a_format_cannot_hold_is_named(body, tool, named):
    with pytest.raises(GrammarUnsupported, match=named):
        answer_grammar(OutputRules(tool_choice="required", tools=(tool,)), fmt_of(body))


# What a model falls back on where the mask takes its own token away: the end, a marker, then what closes JSON
def _fallback(tok) -> list[int]:
    return [EOS, *range(EOS + 1, EOS + 1 + len(SPECIALS)), *b'"}]:,1']


def steered(tokenizer, grammar: str, wish: str, max_tokens: int = 400) -> str:
    """The text a model that wants to write `wish` writes under the grammar (testkit.steered)."""
    ll, tok = tokenizer
    return testkit.steered(ll, tok, grammar, wish, _fallback(tok), EOS, max_tokens)


@pytest.mark.parametrize("body", NEW_FORMATS)
@pytest.mark.parametrize("rules, wish", [
    (REQUIRED, "It is sunny in Paris."),  # a model that would rather answer still calls
    (REQUIRED, [PARIS, CET]),
    (REQUIRED, [("get_weather", {"city": "Paris", "days": "three", "wind": 2})]),  # wrong types give way
    (NAMED, [PARIS]),  # the other tool gives way to the named one
    (ONE, [CET, PARIS]),
    (OutputRules(tool_choice="route", tools=TOOLS), [ROUTE_CALL]),
])
def test_a_forced_call_reads_back_as_a_valid_call(marker_tokenizer, body, rules, wish):
    """Text written under the grammar is what the model's own parser reads as
    calls of allowed tools, their arguments valid against their schemas."""
    if body == "function_gemma" and rules.tool_choice == "route":
        return  # FunctionGemma holds no objects (test_what_a_format_cannot_hold_is_named)
    rules = fitting(rules, body)
    wish_text = wish if isinstance(wish, str) else WRITERS[body](wish)
    text = steered(marker_tokenizer, grammar_for(marker_tokenizer, rules, body), wish_text)
    calls, content, _ = read(text, body)
    assert calls and content.strip() == "", text
    allowed = {t.name: t for t in rules.forced_tools()}
    for name, arguments in calls:
        jsonschema.validate(arguments, allowed[name].parameters)
    if rules in (fitting(ONE, body), fitting(NAMED, body)):
        assert len(calls) == 1, text
    if isinstance(wish, list) and rules == fitting(REQUIRED, body) and "wind" not in json.dumps(wish):
        expected = wish if body != "harmony" else wish[:1]
        assert calls == expected, text


def test_a_harmony_model_is_told_by_its_template():
    harmony = type("Tok", (), {"chat_template": "{{ '<|start|>assistant<|channel|>final<|message|>' }}"})()
    from mlxd.engine.model.tool_prompt import tool_support

    class Plain:
        chat_template = None

    assert tool_support(Plain())[1] is not None  # no template: mlxd's own format
    assert model_parser(harmony).__name__ == "parse_harmony_call"
    assert model_parser(Plain()) is None


def test_max_parallel_calls_caps_a_section(marker_tokenizer):
    many = [CET] * (MAX_PARALLEL_CALLS + 1)
    for body in ("kimi", "pythonic", "minimax"):
        grammar = grammar_for(marker_tokenizer, REQUIRED, body)
        assert accepts(marker_tokenizer, grammar, WRITERS[body](many[:MAX_PARALLEL_CALLS]))
        assert not accepts(marker_tokenizer, grammar, WRITERS[body](many))


@pytest.mark.parametrize("rules", [REQUIRED, OutputRules(schema={"type": "object", "properties": {
    "ok": {"type": "boolean"}}, "required": ["ok"]})], ids=["forced call", "schema"])
def test_harmony_reasoning_has_a_budget_so_the_bound_answer_always_comes(marker_tokenizer, rules):
    """A model that would reason forever (a random-weight one does) is made to close its analysis after the
    budget, and then writes the call or the JSON it must end in."""
    from mlxd.engine.model.constrained import marker_literal

    grammar = answer_grammar(rules, fmt_of("harmony"), literal=marker_literal(marker_tokenizer[0],
                                                                              _Encoder(marker_tokenizer[1])),
                             think_budget=12)
    text = steered(marker_tokenizer, grammar, "<|channel|>analysis<|message|>" + "thinking and thinking " * 40,
                   max_tokens=400)
    assert text.startswith("<|channel|>analysis<|message|>") and "<|end|>" in text
    reasoning = text.split("<|message|>", 1)[1].split("<|end|>", 1)[0]
    assert 0 < len(marker_tokenizer[1].encode(reasoning, add_special_tokens=False).ids) <= 12
    after = text.split("<|end|>", 1)[1]
    assert ("to=functions." in after) if rules is REQUIRED else ("<|channel|>final<|message|>" in after)
