"""Tool-call bodies as grammars, for the formats of mlx-lm's parsers beyond
the first four (engine/model/grammar.py binds json_tools, qwen3_coder,
mistral and glm47 itself): Kimi K2, Gemma 4, FunctionGemma, pythonic (LFM2),
MiniMax M2 and LongCat (pure; no MLX).

Each `*_body(tools, literal)` returns the Lark rules of `call_body`: one call
of one of `tools`, written exactly as the model's own mlx-lm parser reads it
back (tests/engine/test_tool_formats.py checks each against that parser).
Where a format holds several calls between one pair of markers (Kimi,
pythonic, MiniMax: `SECTION_BODIES` in tool_formats.py), `call_body` is one call
and grammar.py repeats it inside the markers.

Gemma's formats are not JSON (bare keys, their own string quotes), so their
values are written by `DialectValues` from the argument's JSON schema; what a
schema asks that the dialect cannot enforce is named (GrammarUnsupported),
never silently dropped.
"""

from __future__ import annotations

import json
import keyword
import re
from dataclasses import dataclass, field
from typing import Any

from .grammar import (GrammarUnsupported, Literal_, ToolSpec, _check_name, _lazy, _regex_escape, _seq, json_rule,
                      quoted)


def in_order(name: str, items: list[tuple[str, bool]], sep: str) -> tuple[list[str], str]:
    """Rules for `items` (Lark expressions, each required or not) in their
    order, `sep` between the ones written, and the expression of the whole
    ("" where there are none; with a `?` where all are optional)."""
    n = len(items)
    if n == 0:
        return [], ""
    all_optional = [all(not req for _, req in items[j:]) for j in range(n)] + [True]
    lines = []
    for j in range(n):
        expr, required = items[j]
        for first in ((True, False) if j else (True,)):
            rule = f"{name}_{j}{'f' if first else 'm'}"
            head = expr if first else _seq(sep, expr)
            rest = f"{name}_{j + 1}m" + ("?" if all_optional[j + 1] else "") if j + 1 < n else ""
            options = [_seq(head, rest)]
            if not required and j + 1 < n:  # skipped: the next one written is the first (or not)
                options.append(f"{name}_{j + 1}{'f' if first else 'm'}")
            lines.append(f"{rule}: " + " | ".join(f"({o})" for o in options))
    return lines, f"{name}_0f" + ("?" if all_optional[0] else "")


def _properties(tool: ToolSpec) -> tuple[list[tuple[str, Any]], set[str]]:
    props = tool.parameters.get("properties") or {}
    return list(props.items()), set(tool.parameters.get("required") or [])


# --- Kimi K2: <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|> ------------

KIMI_TAGS = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")  # special tokens in Kimi's


def kimi_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    """One call of a Kimi section. The parser reads the name between an
    optional `functions.` and `:INDEX`, and the arguments as JSON."""
    begin, argument, end = (literal(t) for t in KIMI_TAGS)
    lines = ["call_body: " + " | ".join(f"kimi_{i}" for i in range(len(tools))), "KIMI_INDEX: /[0-9]{1,3}/"]
    for i, tool in enumerate(tools):
        _check_name(tool.name, r"[^\s<:]+", "Kimi")
        lines.append(f"kimi_{i}_args: {json_rule(tool.parameters)}")
        lines.append(f"kimi_{i}: {begin} {quoted('functions.' + tool.name + ':')} KIMI_INDEX {argument} "
                     f"kimi_{i}_args {end}")
    return lines


# --- pythonic (LFM2 and others): [name(key="value", n=2), other()] ----------------------------------------------

def pythonic_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    """One call of the list: `name(key=value, ...)`, each value JSON (which
    the parser reads as a Python literal, true/false/null included), the
    arguments in the schema's order."""
    lines = ["call_body: " + " | ".join(f"py_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", tool.name) or keyword.iskeyword(tool.name):
            raise GrammarUnsupported(f"the tool name {tool.name!r} cannot be read back from the pythonic "
                                     "tool-call format")
        props, required = _properties(tool)
        items = []
        for j, (name, schema) in enumerate(props):
            if not name.isidentifier() or keyword.iskeyword(name):
                raise GrammarUnsupported(f"the argument name {name!r} of {tool.name!r} cannot be written as a "
                                         "Python keyword argument (the pythonic tool-call format)")
            lines.append(f"py_{i}_{j}_value: {json_rule(schema if isinstance(schema, dict) else {})}")
            items.append((f"{quoted(name + '=')} py_{i}_{j}_value", name in required))
        arg_lines, args = in_order(f"py_{i}_a", items, quoted(", "))
        lines += arg_lines
        lines.append(f"py_{i}: " + _seq(quoted(tool.name + "("), args, quoted(")")))
    return lines


# --- MiniMax M2: <invoke name="NAME">\n<parameter name="K">V</parameter>\n</invoke> -----------------------------

MINIMAX_PARAMETER_END = "</parameter>"


def minimax_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    """One `<invoke>` of a MiniMax section. The parser keeps a value as text
    where the argument's types include "string" (its `_extract_types_from_schema`),
    else converts it by type (JSON reads back right for each); a text value
    ends at its first `</parameter>` and may not spell `</invoke>`."""
    from mlx_lm.tool_parsers.minimax_m2 import _extract_types_from_schema

    lines = ["call_body: " + " | ".join(f"mm_{i}" for i in range(len(tools))),
             "MM_TEXT: /(?s:.*)/ & ~/(?s:.*<\\/invoke>.*)/"]
    for i, tool in enumerate(tools):
        _check_name(tool.name, r'[^\s>"\']+', "MiniMax")
        props, required = _properties(tool)
        params = []
        for j, (name, schema) in enumerate(props):
            _check_name(name, r'[^\s>"\']+', "MiniMax")
            rule = f"mm_{i}_{j}"
            head = quoted(f'<parameter name="{name}">')
            schema = schema if isinstance(schema, dict) else {}
            if "string" in _extract_types_from_schema(schema):
                if schema.get("type") == "string" and isinstance(schema.get("enum"), list):
                    options = " | ".join(quoted(str(v)) for v in schema["enum"])
                    lines.append(f"{rule}: {head} ({options}) {quoted(MINIMAX_PARAMETER_END)}")
                else:
                    lines.append(f"{rule}_text[lazy]: MM_TEXT {quoted(MINIMAX_PARAMETER_END)}")
                    lines.append(f"{rule}: {head} {rule}_text")
            else:
                lines.append(f"{rule}_value: {json_rule(schema)}")
                lines.append(f"{rule}: {head} {rule}_value {quoted(MINIMAX_PARAMETER_END)}")
            params.append(f'{rule} "\\n"' if name in required else f'({rule} "\\n")?')
        lines.append(f"mm_{i}: " + _seq(quoted(f'<invoke name="{tool.name}">\n'), *params, quoted("</invoke>")))
    return lines


# --- Gemma 4 and FunctionGemma: call:NAME{key:value,...} ----------------------------------------------------------

# Schema keys that only describe (nothing to enforce): a dialect grammar may pass over them.
DESCRIPTIVE_KEYS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "deprecated",
                              "readOnly", "writeOnly"})


@dataclass
class DialectValues:
    """Writes JSON-schema values as Lark rules in a JSON-like dialect:
    `string_open`/`string_close` quote a string (markers, as literals), keys
    are bare `\\w+` words, `scalars_only` refuses objects and arrays (a
    format whose parser cannot read them back), `text_excludes` are texts a
    string may not spell (its parser would end the value or the call there)."""

    prefix: str
    string_open: str
    string_close: str
    text_excludes: tuple[str, ...]
    model: str
    scalars_only: bool = False
    lines: list[str] = field(default_factory=list)
    _count: int = 0
    _defined: set[str] = field(default_factory=set)  # the shared rules written so far

    def rule(self, schema: Any) -> str:
        """A rule name whose body is a value of `schema`."""
        self._count += 1
        name = f"{self.prefix}_v{self._count}"
        self.lines.append(f"{name}: {self.value(schema)}")
        return name

    def value(self, schema: Any) -> str:
        if schema is True or schema == {} or not isinstance(schema, dict):
            return self._any()
        unknown = sorted(set(schema) - DESCRIPTIVE_KEYS - {"type", "enum", "const", "properties", "required",
                                                            "items", "additionalProperties", "anyOf"})
        if unknown:
            raise GrammarUnsupported(f"{self.model}'s tool-call format cannot bind the schema keys {unknown}")
        if "const" in schema:
            return self._literal_value(schema["const"])
        if isinstance(schema.get("enum"), list):
            return "(" + " | ".join(self._literal_value(v) for v in schema["enum"]) + ")"
        if isinstance(schema.get("anyOf"), list):
            return "(" + " | ".join(self.rule(s) for s in schema["anyOf"]) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.rule({**schema, "type": k}) for k in kind) + ")"
        if kind is None:
            return self._any()
        if kind == "string":
            return self._string()
        if kind == "integer":
            return "/-?(0|[1-9][0-9]{0,17})/"
        if kind == "number":
            return "/-?(0|[1-9][0-9]{0,17})(\\.[0-9]{1,17})?([eE][-+]?[0-9]{1,3})?/"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if self.scalars_only:
            raise GrammarUnsupported(f"{self.model}'s tool-call format cannot hold an argument of type {kind!r}")
        if kind == "array":
            item = self.rule(schema.get("items", {}))
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind == "object":
            return self._object(schema)
        raise GrammarUnsupported(f"{self.model}'s tool-call format cannot bind the schema type {kind!r}")

    def arguments(self, properties: list[tuple[str, Any]], required: set[str], name: str) -> str:
        """`{key:value,...}` in the schema's order, the required keys present."""
        items = []
        for key, schema in properties:
            if not re.fullmatch(r"\w+", key):
                raise GrammarUnsupported(f"the argument name {key!r} cannot be read back from {self.model}'s "
                                         "tool-call format")
            items.append((f"{quoted(key + ':')} {self.rule(schema)}", key in required))
        arg_lines, args = in_order(name, items, '","')
        self.lines += arg_lines
        return _seq('"{"', args, '"}"')

    def _object(self, schema: dict[str, Any]) -> str:
        if "properties" in schema:
            if schema.get("additionalProperties") not in (None, False):
                raise GrammarUnsupported(f"{self.model}'s tool-call format cannot bind an object with both "
                                         "properties and additionalProperties")
            props = list((schema.get("properties") or {}).items())
            self._count += 1
            return self.arguments(props, set(schema.get("required") or []), f"{self.prefix}_o{self._count}")
        value = self.rule(schema.get("additionalProperties", {}) if isinstance(
            schema.get("additionalProperties"), dict) else {})
        return f'"{{" ({self.prefix}_KEY ":" {value} ("," {self.prefix}_KEY ":" {value})*)? "}}"'

    def _string(self) -> str:
        name = f"{self.prefix}_string"
        if name not in self._defined:
            self._defined.add(name)
            excluded = "|".join(_regex_escape(t) for t in self.text_excludes)
            close = self.string_close
            self.lines.append(f"{self.prefix.upper()}_TEXT: /(?s:.*)/ & ~/(?s:.*({excluded}).*)/")
            self.lines.append(f"{name}_text{_lazy(close)}: {self.prefix.upper()}_TEXT {close}")
            self.lines.append(f"{name}: {self.string_open} {name}_text")
        return name

    def _literal_value(self, value: Any) -> str:
        if isinstance(value, str):
            if any(t in value for t in self.text_excludes):
                raise GrammarUnsupported(f"the value {value!r} cannot be written in {self.model}'s tool-call format")
            return f"{self.string_open} {quoted(value)} {self.string_close}"
        if isinstance(value, (dict, list)):
            if self.scalars_only:
                raise GrammarUnsupported(f"{self.model}'s tool-call format cannot hold the value {value!r}")
            raise GrammarUnsupported(f"{self.model}'s tool-call format cannot bind an object or array constant")
        return quoted(json.dumps(value))

    def _any(self) -> str:
        """Any value of the dialect (a schema that says nothing)."""
        name = f"{self.prefix}_any"
        if name not in self._defined:
            self._defined.add(name)
            options = [self._string(), '"true"', '"false"', '"null"', "/-?(0|[1-9][0-9]{0,17})(\\.[0-9]{1,17})?/"]
            if not self.scalars_only:
                self.lines.append(f"{self.prefix}_KEY: /[A-Za-z_][A-Za-z0-9_]{{0,63}}/")
                options += [f'"[" ({name} ("," {name})*)? "]"',
                            f'"{{" ({self.prefix}_KEY ":" {name} ("," {self.prefix}_KEY ":" {name})*)? "}}"']
            self.lines.append(f"{name}: " + " | ".join(options))
        return name


GEMMA4_QUOTE = '<|"|>'  # Gemma 4's string delimiter (a token of its own)


def gemma4_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    """`call:NAME{key:value,...}`: bare keys, strings between `<|"|>`, other
    values JSON; the parser turns it into JSON and reads that."""
    values = DialectValues("g4", literal(GEMMA4_QUOTE), literal(GEMMA4_QUOTE), (GEMMA4_QUOTE,), "Gemma 4")
    return _call_colon_body(tools, values, r"[\w-]+")


FUNCTION_GEMMA_ESCAPE = "<escape>"


def function_gemma_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    """`call:NAME{key:value,...}`: strings between `<escape>`, numbers and
    booleans bare. Its parser reads to the first `}` and splits at commas, so
    no objects or arrays, and no `}` in a string."""
    escape = literal(FUNCTION_GEMMA_ESCAPE)
    values = DialectValues("fg", escape, escape, (FUNCTION_GEMMA_ESCAPE, "}"), "FunctionGemma", scalars_only=True)
    return _call_colon_body(tools, values, r"\w+")


def _call_colon_body(tools: tuple[ToolSpec, ...], values: DialectValues, name_pattern: str) -> list[str]:
    calls = []
    for i, tool in enumerate(tools):
        _check_name(tool.name, name_pattern, values.model)
        props, required = _properties(tool)
        arguments = values.arguments(props, required, f"{values.prefix}_{i}_a")
        values.lines.append(f"{values.prefix}_{i}: {quoted('call:' + tool.name)} {arguments}")
        calls.append(f"{values.prefix}_{i}")
    return ["call_body: " + " | ".join(calls)] + values.lines
