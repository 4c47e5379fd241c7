"""docs/LIMITS.md, the one table of every request field's limits, is current
(generated from the request models), and a refusal's `param` names a row of
it (engine/api/request_limits.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from mlxd.engine.api.request_limits import ROUTES, limits_markdown, schema_limits
from mlxd.engine.api.request_schema import describe_validation_errors

DOC = Path(__file__).resolve().parents[2] / "docs" / "LIMITS.md"
MODELS = dict(ROUTES)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_the_limits_table_is_current():
    assert DOC.read_text() == limits_markdown(), "run: python -m mlxd.engine.api.request_limits > docs/LIMITS.md"


@pytest.mark.parametrize("route, body", [
    ("POST /v1/chat/completions", {**CHAT, "temperature": 2.5}),
    ("POST /v1/chat/completions", {**CHAT, "model": "m" * 300}),
    ("POST /v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}),
    ("POST /v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "n" * 300}}]}),
    ("POST /v1/chat/completions", {**CHAT, "messages": []}),
    ("POST /v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 0}),
    ("POST /v1/messages", {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                           "top_k": -1}),
    ("POST /v1/embeddings", {"model": "m", "input": "x", "dimensions": 0}),
])
def test_a_refusals_param_is_a_row_of_the_table(route, body):
    with pytest.raises(ValidationError) as info:
        MODELS[route].model_validate(body)
    _, param, _ = describe_validation_errors(info.value.errors())
    field = "logit_bias.*" if param.startswith("logit_bias.") else re.sub(r"\.(\d+)", "[]", param)
    rows = {(r, f) for r, model in ROUTES for f, _ in schema_limits(model.model_json_schema(),
                                                                       model.model_json_schema().get("$defs", {}))}
    assert (route, field) in rows, (param, field)


def test_a_model_met_below_itself_is_walked_once_and_branches_do_not_repeat():
    defs = {"Node": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                                       "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}
    schema = {"anyOf": [{"$ref": "#/$defs/Node"}, {"$ref": "#/$defs/Node"}]}
    assert schema_limits(schema, defs) == [("name", "length ≤ 3")]
