"""Tool calls in generated text.

Models that call tools write them between markers (e.g. `<tool_call>` ...
`</tool_call>`); mlx-lm's tokenizer wrapper knows a model's markers and its
parser. engine/model/answer_parts.py cuts the calls' bodies out of the streamed
text; `format_tool_calls` turns them into OpenAI's shape.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable

log = logging.getLogger("mlxd.engine.model.tool_calls")


def format_tool_calls(bodies: list[str], parser: Callable[[str, Any], Any], tools: Any) -> tuple[list[dict], str]:
    """Parse bodies into OpenAI tool calls; what does not parse comes back
    as text, so nothing the model wrote is lost."""
    calls: list[dict] = []
    unparsed: list[str] = []
    for body in bodies:
        try:
            parsed = parser(body, tools)
        except Exception as exc:  # noqa: BLE001 - a model's malformed call is data, not a fault
            log.warning("tool call did not parse (%s): %.200r", type(exc).__name__, body)
            unparsed.append(body)
            continue
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or "name" not in call:
                unparsed.append(body)
                continue
            args = call.get("arguments", {})
            calls.append({
                "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": str(call["name"]),
                             "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)},
            })
    return calls, "".join(unparsed)
