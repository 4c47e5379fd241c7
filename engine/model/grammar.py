"""What an answer must look like, as a grammar (pure; no MLX).

A request can bind its answer: `response_format` json_object / json_schema
(and the Responses API's `text.format`), `tool_choice` "required" or a named
function, `parallel_tool_calls: false`. `OutputRules` is that binding, read
from the request once; engine/model/answer_grammar.py turns it into a Lark grammar for
llguidance (engine/model/constrained.py applies it token by token), in the model's
own tool-call format (`ToolFormat`, engine/model/tool_formats.py) and after its
reasoning, where it thinks. Here: the rules, the Lark pieces and mlx-lm's own
formats' call bodies.

Why llguidance: it is already installed (LiteLLM depends on it), computes a
mask in microseconds on a large vocabulary (docs/BENCHMARKS.md, "Why the
engine is built as it is"), compiles
JSON schemas lazily (no up-front index as outlines-core builds, which takes
seconds for large schemas), embeds JSON schemas in Lark grammars (a tool call
is markers around a schema) and names what it cannot enforce ("Unimplemented
keys: [\"if\"]"), which becomes the 400 `unsupported_parameter`. xgrammar
needs PyTorch to install; outlines-core has no Lark grammars.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

# The schema of "any JSON object" (response_format json_object).
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Whitespace between JSON tokens: a newline and an indent, or a space or two.
# llguidance's default ([ \t\n\r]+) lets a small model write whitespace
# until max_tokens (seen on the default model: a forced call never closed);
# bounded slots keep the answer finite and still allow pretty-printed JSON.
# The most calls a bound answer may make at once (parallel_tool_calls).
MAX_PARALLEL_CALLS = 8
JSON_OPTIONS = {"whitespace_pattern": "\n[ \t]{0,24}|[ ]{1,2}"}


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule body: `schema` as llguidance's %json, with mlxd's whitespace,
    its objects closed (`closed`)."""
    return "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **closed(schema)}, separators=(",", ":"))


# Where a JSON schema holds schemas: a map of them, a list of them, or one.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "additionalProperties", "unevaluatedProperties", "unevaluatedItems")


def closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties and says nothing
    of others closed (`additionalProperties: false`), as xgrammar's strict
    mode and llama.cpp's converter do (pure). Every answer is still valid
    against the schema; open, a small model added keys until max_tokens
    (instructor's and pydantic's schemas leave them open)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in SCHEMA_ONE:
        if key in out:
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarUnsupported(ValueError):
    """A schema or format the grammar engine cannot enforce; the message names the feature."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]  # the arguments' JSON schema ({"type": "object"} when the tool gave none)
    strict: bool = False


@dataclass(frozen=True)
class OutputRules:
    """How a request binds its answer (pure data, read from the request).
    `schema`: the JSON schema the content must match, None for free text.
    `tool_choice`: "auto", "none", "required" or the one function's name."""

    schema: dict[str, Any] | None = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    tools: tuple[ToolSpec, ...] = field(default=())

    @property
    def forces_tool(self) -> bool:
        return bool(self.tools) and self.tool_choice not in ("auto", "none")

    @property
    def constrained(self) -> bool:
        """Whether decoding needs a grammar at all ("none" with tools offered:
        the answer may not open a call)."""
        if self.tool_choice == "none":
            return self.schema is not None or bool(self.tools)
        return self.schema is not None or self.forces_tool or any(t.strict for t in self.tools)

    def describe(self) -> str:
        """For the log: what binds the answer."""
        parts = []
        if self.schema is not None:
            parts.append("a JSON schema" if self.schema != ANY_OBJECT else "a JSON object")
        if self.forces_tool:
            parts.append(f"tool_choice {self.tool_choice}" + ("" if self.parallel_tool_calls else ", one call"))
        elif any(t.strict for t in self.tools) and self.tool_choice != "none":
            parts.append("strict tools")
        return ", ".join(parts) or "nothing"

    def forced_tools(self) -> tuple[ToolSpec, ...]:
        if self.tool_choice in ("auto", "none", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.tool_choice)


def schema_problem(schema: Any) -> str | None:
    """Why llguidance cannot enforce this JSON schema, or None."""
    import llguidance

    if not isinstance(schema, dict):
        return "a JSON schema must be an object"
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        failed, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        return str(exc)
    if failed or warnings:  # a warning is a part of the schema that would be ignored: never silently
        return "; ".join(" ".join(w.split()) for w in warnings) or "not enforceable"  # one line each
    return None


def grammar_problem(lark: str) -> str | None:
    """Why llguidance cannot compile this Lark grammar, or None."""
    import llguidance

    try:
        failed, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(lark))
    except (ValueError, TypeError, RuntimeError) as exc:
        return str(exc)
    return "; ".join(" ".join(w.split()) for w in warnings) or "not enforceable" if failed else None


def call_schema(tools: tuple[ToolSpec, ...]) -> dict[str, Any]:
    """The JSON schema of one call's body: {"name": one of the tools, "arguments": its schema}."""
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


Literal_ = Callable[[str], str]  # a text as a Lark literal: quoted text, or a special token's <[id]>


def quoted(text: str) -> str:
    return json.dumps(text)


def _lazy(marker: str) -> str:
    """A rule of text up to `marker` ends at its first match (lazy) where the
    marker is text; text never holds a special token, so there it needs no
    laziness (and llguidance allows none)."""
    return "" if marker.startswith("<[") else "[lazy]"


REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~/")  # escaped in a regex (the Rust regex crate's; a letter never is)


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (no slash unescaped)."""
    return "".join("\\" + c if c in REGEX_META else c for c in text)


def spelled(text: str, literal: Literal_) -> str:
    """A marker as Lark: where it holds `<|...|>` tokens among text (harmony's
    `<|channel|>commentary to=`), each token and each text piece written on
    its own, so a special token is named by id."""
    pieces = [p for p in re.split(r"(<\|[^|<>]*\|>)", text) if p]
    return " ".join(literal(p) for p in pieces) if len(pieces) > 1 else literal(text)


def _json_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    return ["call_body: " + json_rule(call_schema(tools))]


def _xml_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    lines = ["call_body: " + " | ".join(f"function_{i}" for i in range(len(tools))),
             "VALUE_TEXT: /(.|\\n)*/"]
    for i, tool in enumerate(tools):
        props = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or [])
        params = []
        for j, (name, schema) in enumerate(props.items()):
            rule = f"parameter_{i}_{j}"
            head = json.dumps(f"<parameter={name}>\n")
            if not isinstance(schema, dict) or _is_plain_string(schema):
                # the parser takes a string's text as it stands: up to the first closing tag
                lines.append(f"{rule}_text[lazy]: VALUE_TEXT {json.dumps(PARAMETER_END)}")
                lines.append(f"{rule}: {head} {rule}_text")
            elif schema.get("type") == "string" and isinstance(schema.get("enum"), list):
                options = " | ".join(json.dumps(str(v)) for v in schema["enum"])
                lines.append(f"{rule}: {head} ({options}) {json.dumps(PARAMETER_END)}")
            else:  # numbers, booleans, objects, arrays: JSON, which the parser converts by the schema's type
                lines.append(f"{rule}_value: {json_rule(schema)}")
                lines.append(f"{rule}: {head} {rule}_value {json.dumps(PARAMETER_END)}")
            params.append(rule if name in required else f"{rule}?")
        lines.append(f"function_{i}: {json.dumps(f'<function={tool.name}>' + chr(10))} {' '.join(params)} "
                     f"{json.dumps('</function>')}")
    return lines


PARAMETER_END = "\n</parameter>\n"


def _is_plain_string(schema: dict[str, Any]) -> bool:
    """A string argument without an enum (the XML body holds it as raw text)."""
    return schema.get("type") == "string" and "enum" not in schema


# Mistral's separator of a call's name and its JSON arguments (a control token in its tekken vocabulary).
MISTRAL_ARGS = "[ARGS]"


def _mistral_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    """`NAME[ARGS]{arguments}`: the parser reads a `[\\w-]+` name before `[ARGS]`
    and the one JSON value after it."""
    lines = ["call_body: " + " | ".join(f"mistral_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        _check_name(tool.name, r"[\w-]+", "Mistral")
        lines.append(f"mistral_{i}_args: {json_rule(tool.parameters)}")
        lines.append(f"mistral_{i}: {quoted(tool.name)} {literal(MISTRAL_ARGS)} mistral_{i}_args")
    return lines


OPTIONAL_NEWLINE = '"\\n"?'
GLM_TAGS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")  # special tokens in GLM's vocabulary
LONGCAT_TAGS = ("<longcat_arg_key>", "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>")


def _glm_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    return _arg_key_body(tools, literal, GLM_TAGS, "GLM", "glm")


def _longcat_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    """LongCat's calls: GLM's with `<longcat_arg_key>` tags; its longcat parser reads them as glm47 does."""
    return _arg_key_body(tools, literal, LONGCAT_TAGS, "LongCat", "lc")


def _arg_key_body(tools: tuple[ToolSpec, ...], literal: Literal_, tags: tuple[str, str, str, str], model: str,
                  prefix: str) -> list[str]:
    """`NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` per argument
    (`tags`: the four tags' texts). The glm47 parser strips names, keys and values, keeps a value whose schema
    says `"type": "string"` as raw text and reads any other as JSON; a newline
    where GLM-4.5 writes one (after the name, between the tags) is allowed."""
    key_open, key_close, value_open, value_close = (literal(t) for t in tags)
    lines = ["call_body: " + " | ".join(f"{prefix}_{i}" for i in range(len(tools)))]
    if value_close.startswith('"'):  # text: a raw value ends at its first closing tag (lazy), as the parser's does
        lines.append(f"{prefix.upper()}_TEXT: /(.|\\n)*/")
    else:  # a special token: the value's text may not spell it either, or the parser would cut the value there
        lines.append(f"{prefix.upper()}_TEXT: /(?s:.*)/ & ~/(?s:.*{_regex_escape(tags[3])}.*)/")
    for i, tool in enumerate(tools):
        _check_name(tool.name, r"[^\s<]+", model)  # the parser strips a name, and splits one at a space
        props = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or [])
        args = []
        for j, (name, schema) in enumerate(props.items()):
            rule = f"{prefix}_{i}_{j}"
            schema = schema if isinstance(schema, dict) else {}
            if schema.get("type") == "string" and isinstance(schema.get("enum"), list):
                value = "(" + " | ".join(quoted(str(v)) for v in schema["enum"]) + f") {value_close}"
            elif schema.get("type") == "string":  # raw text, exactly where the parser keeps it raw
                lines.append(f"{rule}_text{_lazy(value_close)}: {prefix.upper()}_TEXT {value_close}")
                value = f"{rule}_text"
            else:  # JSON, which the parser decodes
                lines.append(f"{rule}_value: {json_rule(schema)}")
                value = f"{rule}_value {value_close}"
            lines.append(f"{rule}: {key_open} {quoted(name)} {key_close} {OPTIONAL_NEWLINE} {value_open} {value} "
                         f"{OPTIONAL_NEWLINE}")
            args.append(rule if name in required else f"{rule}?")
        lines.append(f"{prefix}_{i}: " + _seq(quoted(tool.name), OPTIONAL_NEWLINE, *args))
    return lines


def _check_name(name: str, pattern: str, model: str) -> None:
    """A tool name the model's parser would read back differently cannot be bound."""
    if not re.fullmatch(pattern, name):
        raise GrammarUnsupported(f"the tool name {name!r} cannot be read back from {model}'s tool-call format")


def _seq(*parts: str) -> str:
    """Lark expressions in sequence, the empty ones left out."""
    return " ".join(p for p in parts if p)


BODY_RULES: dict[str, Callable[[tuple[ToolSpec, ...], Literal_], list[str]]] = {
    "json": _json_body, "xml": _xml_body, "mistral": _mistral_body, "glm": _glm_body, "longcat": _longcat_body}


def think_rules(end: str, budget: int | None) -> list[str]:
    """The reasoning block's rules, up to its `end` marker: where the marker
    is text, one lazy rule (it ends at the marker's first match: _lazy);
    where it is a special token, which text never holds, at most `budget`
    tokens of text before it (llguidance caps a terminal only, and not a
    lazy rule's), after which the grammar closes the block."""
    if _lazy(end) or not budget:
        return ["THINK_TEXT: /(.|\\n)*/", f"think{_lazy(end)}: THINK_TEXT {end}"]
    return [f"think_text[max_tokens={budget}]: /(.|\\n)*/", f"think: think_text {end}"]
