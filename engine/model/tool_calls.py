"""Tool calls in generated text.

Models that call tools write them between markers (e.g. `<tool_call>` ...
`</tool_call>`); mlx-lm's tokenizer wrapper knows a model's markers and its
parser (`model_parser`; for gpt-oss, which mlx-lm has none for, mlx-vlm's
harmony parser). engine/model/answer_parts.py cuts the calls' bodies out of
the streamed text; `format_tool_calls` turns them into OpenAI's shape,
leniently: a call malformed in a way seen in the field is repaired
(engine/model/call_repair.py) and the repair logged; what still does not
parse comes back as text.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable

from .call_repair import NORMALIZATIONS, RECOVERIES, arguments_object, sensible_calls
from .harmony import is_harmony, parse_harmony_call

log = logging.getLogger("mlxd.engine.model.tool_calls")

Parser = Callable[[str, Any], Any]


def model_parser(tokenizer: Any) -> Parser | None:
    """The parser of the model's own tool-call format (None where it has none)."""
    if is_harmony(tokenizer):
        return parse_harmony_call
    return getattr(tokenizer, "tool_parser", None)


def format_tool_calls(bodies: list[str], parser: Parser, tools: Any) -> tuple[list[dict], str]:
    """Parse bodies into OpenAI tool calls; what does not parse comes back
    as text, so nothing the model wrote is lost."""
    calls: list[dict] = []
    unparsed: list[str] = []
    for body in bodies:
        parsed, left_over, repairs = parse_leniently(body, parser, tools)
        if parsed is None:
            unparsed.append(body)
            continue
        for call in parsed:
            args, after, repaired = arguments_object(call.get("arguments", {}))
            if repaired:
                repairs.append("text after the arguments' JSON")
                left_over += after
            calls.append({
                "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"],
                             "arguments": args if isinstance(args, str) else json.dumps(args or {},
                                                                                       ensure_ascii=False)},
            })
        if repairs:
            log.warning("tool call recovered (%s): %.200r", "; ".join(repairs), body)
        if left_over:
            unparsed.append(left_over)
    return calls, "".join(unparsed)


def parse_leniently(body: str, parser: Parser, tools: Any) -> tuple[list[dict] | None, str, list[str]]:
    """(the calls or None, text left over, the repairs made): the body
    normalized, parsed; where that gives no sensible call, each recovery in
    turn until one does."""
    repairs: list[str] = []
    for name, normalize in NORMALIZATIONS:
        fixed = normalize(body)
        if fixed is not None:
            body = fixed[0]
            repairs.append(name)
    calls, error = _parse(body, parser, tools)
    if calls is not None:
        return calls, "", repairs
    for name, recover in RECOVERIES:
        fixed = recover(body)
        if fixed is None:
            continue
        calls, _ = _parse(fixed[0], parser, tools)
        if calls is not None and _all_offered(calls, tools):  # a repair's guess must fit a tool the request has
            return calls, fixed[1], repairs + [name]
    log.warning("tool call did not parse (%s): %.200r", error, body)
    return None, "", repairs


def _all_offered(calls: list[dict], tools: Any) -> bool:
    """Whether each call names an offered tool and gives its required
    arguments (a call cut before them is not recovered)."""
    offered = {t["function"].get("name"): t["function"].get("parameters") or {}
               for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)}
    if not offered:
        return True
    for call in calls:
        if call["name"] not in offered:
            return False
        args = call.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {}
        required = offered[call["name"]].get("required") or []
        if not isinstance(args, dict) or any(name not in args for name in required):
            return False
    return True


def _parse(body: str, parser: Parser, tools: Any) -> tuple[list[dict] | None, str]:
    try:
        parsed = parser(body, tools)
    except Exception as exc:  # noqa: BLE001 - a model's malformed call is data, not a fault
        return None, type(exc).__name__
    calls = sensible_calls(parsed)
    return calls, "" if calls is not None else "no sensible call"
