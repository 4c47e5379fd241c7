"""mlxd.toml_text: what it writes reads back (tomllib) as the values it was
given; strings are escaped per the TOML spec; what TOML cannot say raises."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mlxd.toml_text import dumps, key, string, table_lines, value

# value -> its TOML text, exactly
VALUES = [
    (True, "true"),
    (False, "false"),
    (0, "0"),
    (-42, "-42"),
    (2**63 - 1, "9223372036854775807"),
    (0.5, "0.5"),
    (1.0, "1.0"),
    (1e-05, "1e-05"),
    (1e16, "1e+16"),
    (float("inf"), "inf"),
    (float("-inf"), "-inf"),
    ("", '""'),
    ("plain", '"plain"'),
    ('say "hi"', r'"say \"hi\""'),
    ("C:\\models\\a", r'"C:\\models\\a"'),
    ("tab\there\nnew line\r\x08\x0c", r'"tab\there\nnew line\r\b\f"'),
    ("\x00\x1f\x7f", r'"\u0000\u001F\u007F"'),
    ("héllo 你好 🙂", '"héllo 你好 🙂"'),  # written as itself, never as surrogate pairs
    (Path("/m/a b/it's"), '"/m/a b/it\'s"'),
    ([], "[]"),
    ([1, "a", [True]], '[1, "a", [true]]'),
    (("127.0.0.1:8080", "local"), '["127.0.0.1:8080", "local"]'),
    ({}, "{}"),
    ({"enabled": False, "max bytes": 3}, '{enabled = false, "max bytes" = 3}'),
]


@pytest.mark.parametrize("v, text", VALUES, ids=[repr(v) for v, _ in VALUES])
def test_a_value_is_written_as_toml_and_reads_back(v, text):
    assert value(v) == text
    expected = str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
    assert tomllib.loads(f"x = {text}")["x"] == expected


def test_nan_is_written_as_nan():
    assert value(float("nan")) == "nan" and math.isnan(tomllib.loads("x = nan")["x"])


@pytest.mark.parametrize("name, text", [
    ("port", "port"), ("demo-a", "demo-a"), ("max_tokens_cap", "max_tokens_cap"), ("3", "3"),
    ("llama3.1:70b", '"llama3.1:70b"'), ("a b", '"a b"'), ("", '""'), ("é", '"é"'),
])
def test_a_key_is_bare_where_toml_allows_else_quoted(name, text):
    assert key(name) == text
    assert list(tomllib.loads(f"{text} = 1")) == [name]


@pytest.mark.parametrize("bad", [None, b"bytes", {1, 2}, object(), {"k": None}, [None]])
def test_what_toml_cannot_say_raises(bad):
    with pytest.raises(TypeError):
        value(bad)


def test_a_key_that_is_not_a_string_raises():
    with pytest.raises(TypeError):
        dumps({"engine": {1: 2}})


DOCS = [
    {},
    {"top": 1},
    {"engine": {}},
    {"engine": {"port": 8080, "prompt_cache": {"enabled": False, "disk": True}}},
    {"models": {"demo-a": {"path": "/m/a"}, "llama3.1:70b": {"repo": "x/y"}}},
    {"top": "first", "models": {"m": {"hosts": ["local", "10.0.0.2:8080"], "ollama": "m:latest"}},
     "aliases": {"default": "m"}},
    {"a": {"b": {"c": {"d": 1}}, "e": 2}},
    {"gateway": {"enabled": False}, "supervisor": {}, "engine": {"ranks": {"hosts": ["127.0.0.1"] * 2}}},
]


@pytest.mark.parametrize("doc", DOCS, ids=range(len(DOCS)))
def test_a_document_reads_back_as_given(doc):
    assert tomllib.loads(dumps(doc)) == doc


def test_a_document_has_plain_values_first_and_a_header_per_table():
    doc = {"engine": {"port": 1, "prompt_cache": {"enabled": False}}, "models": {"demo-a": {"path": "/m"}},
           "aliases": {"default": "demo-a"}}
    assert dumps(doc) == ('[engine]\nport = 1\n\n[engine.prompt_cache]\nenabled = false\n\n'
                          '[models.demo-a]\npath = "/m"\n\n[aliases]\ndefault = "demo-a"\n')


def test_table_lines_are_a_table_body():
    text = table_lines({"stuck_grace_s": 1.5, "log_level": "debug", "prompt_cache": {"enabled": False}})
    assert text == 'stuck_grace_s = 1.5\nlog_level = "debug"\nprompt_cache = {enabled = false}\n'
    assert tomllib.loads("[engine]\n" + text)["engine"]["prompt_cache"] == {"enabled": False}


@given(st.text())
@example("x")
@example("a.b")
@example("")
def test_every_string_reads_back_as_itself(text):
    doc = tomllib.loads(f"[value]\nx = {string(text)}\n[keys]\n{key(text)} = 1")  # apart: text may be "x"
    assert doc["value"]["x"] == text and doc["keys"] == {text: 1}


@given(st.dictionaries(st.text(min_size=1, max_size=8),
                       st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text()
                                    | st.floats(allow_nan=False),
                                    lambda inner: st.lists(inner, max_size=3)
                                    | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                                    max_leaves=8).filter(lambda v: v is not None),
                       max_size=4))
def test_every_document_of_the_subset_reads_back_or_raises(doc):
    try:
        text = dumps({"t": doc})
    except TypeError:  # a None somewhere inside
        return
    assert tomllib.loads(text) == {"t": doc}
