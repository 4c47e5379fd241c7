"""TOML text from values: the one writer for every mlxd.toml that code
builds (test and benchmark configs, paths among them). Python reads TOML
(tomllib) but does not write it; this covers the subset mlxd's config
uses -- tables, strings, integers, floats, booleans, and lists and inline
tables of those -- and nothing else (a value of another type raises
TypeError, so nothing is ever written that would read back differently).

    dumps({"engine": {"port": 8080}, "models": {"demo-a": {"path": Path("/m/a b")}}})
    ->  [engine]
        port = 8080

        [models.demo-a]
        path = "/m/a b"

Strings (and paths, written as strings) are TOML basic strings, escaped per
the spec: backslash, double quote and every control character; any other
character, non-ASCII included, is written as itself (the file is UTF-8).
Pure: no I/O.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["dumps", "table_lines", "value", "key", "string"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_NAMED_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}
# What a basic string may not hold as itself: " and \, U+0000-U+001F and U+007F.
_MUST_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f]')


def string(text: str) -> str:
    """`text` as a TOML basic string, quotes included."""
    return '"' + _MUST_ESCAPE.sub(lambda m: _NAMED_ESCAPES.get(m.group(), f"\\u{ord(m.group()):04X}"), text) + '"'


def key(name: str) -> str:
    """A key as written: bare where TOML allows (letters, digits, _ and -), else quoted."""
    if not isinstance(name, str):
        raise TypeError(f"a TOML key must be a string, not {type(name).__name__}: {name!r}")
    return name if _BARE_KEY.fullmatch(name) else string(name)


def value(v: Any) -> str:
    """One value on one line: a mapping as an inline table, a list as an array."""
    if isinstance(v, bool):  # before int: bool is an int
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)  # 0.5, 1e-05, 1e+16: each a TOML float
    if isinstance(v, str):
        return string(v)
    if isinstance(v, os.PathLike):
        return string(os.fspath(v))
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {type(v).__name__}: {v!r}")


def table_lines(values: Mapping[str, Any]) -> str:
    """`key = value` lines, one per entry (a mapping as an inline table): the
    body of one table, for text that adds lines to a table it names itself."""
    return "".join(f"{key(k)} = {value(v)}\n" for k, v in values.items())


def dumps(doc: Mapping[str, Any]) -> str:
    """A whole TOML document: the top level's plain values first, then each
    mapping as a [table] ([a.b] for one inside another), in the mapping's
    order. A table is given a header of its own when it has plain values or
    none at all (so an empty table reads back); one holding only tables is
    implied by theirs."""
    return _table((), doc).lstrip("\n")


def _table(path: tuple[str, ...], values: Mapping[str, Any]) -> str:
    plain = {k: v for k, v in values.items() if not isinstance(v, Mapping)}
    tables = {k: v for k, v in values.items() if isinstance(v, Mapping)}
    text = ""
    if path and (plain or not tables):
        text = "\n[" + ".".join(key(p) for p in path) + "]\n"
    text += table_lines(plain)
    for name, sub in tables.items():
        text += _table((*path, name), sub)
    return text
