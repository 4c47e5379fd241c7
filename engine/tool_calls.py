"""Tool calls in generated text.

Models that call tools write them between markers (e.g. `<tool_call>` ...
`</tool_call>`); mlx-lm's tokenizer wrapper knows a model's markers and its
parser. `ToolCallSplitter` separates streamed text into plain content and
complete tool-call bodies (pure: markers may straddle pieces);
`format_tool_calls` turns parsed calls into OpenAI's shape.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable

log = logging.getLogger("mlxd.engine.tool_calls")


def _held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that starts `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallSplitter:
    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self._buf = ""
        self._in_call = False

    def feed(self, piece: str) -> tuple[str, list[str]]:
        """Text safe to emit now, and tool-call bodies completed by `piece`."""
        self._buf += piece
        text_out: list[str] = []
        calls: list[str] = []
        while True:
            if self._in_call:
                i = self._buf.find(self.end)
                if i < 0:
                    return "".join(text_out), calls
                calls.append(self._buf[:i])
                self._buf = self._buf[i + len(self.end):]
                self._in_call = False
            else:
                i = self._buf.find(self.start)
                if i < 0:
                    keep = _held_prefix_len(self._buf, self.start)
                    text_out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return "".join(text_out), calls
                text_out.append(self._buf[:i])
                self._buf = self._buf[i + len(self.start):]
                self._in_call = True

    def flush(self) -> tuple[str, list[str]]:
        """End of generation: an unterminated call is still tried as a call."""
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return "", [buf] if buf.strip() else []
        return buf, []


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
