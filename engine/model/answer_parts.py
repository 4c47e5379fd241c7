"""What a model writes, split into reasoning, content and tool calls.

Reasoning models write `<think>…</think>` before their answer (or only the
closing tag, where the chat template opened the block in the prompt); models
that call tools write each call between markers (`<tool_call>…</tool_call>`).
mlx-lm's tokenizer wrapper knows a model's markers, and its `TextStateMachine`
(the streaming splitter `mlx_lm.server` uses) moves between states on them,
holding back a marker split across pieces. `AnswerSplitter` drives it and
hands out parts: reasoning text, content text and complete tool-call bodies
(which engine/model/tool_calls.py turns into OpenAI's shape).

The streamed and the non-streamed answer go through the same splitter, piece
by piece, so a non-streamed message is exactly the concatenated stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from .harmony import CALL_END, CALL_START, harmony_edges, is_harmony

PartKind = Literal["content", "reasoning", "tool"]


@dataclass(frozen=True)
class Part:
    kind: PartKind
    text: str  # for "tool": one whole call's body, markers stripped


@dataclass(frozen=True)
class Markers:
    """The markers a model writes; None where it has none (or, for tools,
    where the request offered no tools: then a marker is just text)."""

    think: tuple[str, str] | None = None
    tool: tuple[str, str | None] | None = None  # no end marker: a call runs to the end
    harmony: bool = False  # gpt-oss's channels (engine/model/harmony.py) instead of think markers


def markers_of(tokenizer: Any, tools_requested: bool) -> Markers:
    if is_harmony(tokenizer):
        return Markers(None, (CALL_START, CALL_END) if tools_requested else None, harmony=True)
    think = ((tokenizer.think_start, tokenizer.think_end)
             if getattr(tokenizer, "has_thinking", False) and tokenizer.think_end else None)
    tool = ((tokenizer.tool_call_start, tokenizer.tool_call_end or None)
            if tools_requested and getattr(tokenizer, "has_tool_calling", False) else None)
    return Markers(think, tool)


def opens_in_reasoning(tokenizer: Any, prompt: Sequence[int]) -> bool:
    """Whether the answer starts inside a reasoning block: the prompt's last
    think-start token comes after its last think-end (the chat template
    opened the block; the model writes only `…</think>`). As mlx_lm.server
    decides it."""
    if not getattr(tokenizer, "has_thinking", False) or not prompt:
        return False
    tokens = list(prompt)
    return tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens)


def closes_reasoning(tokenizer: Any, prompt: Sequence[int]) -> bool:
    """Whether the prompt ends with this turn's reasoning block already
    closed (its last think-end followed by nothing but whitespace): the
    template's way of turning thinking off (Qwen3's `enable_thinking:
    false` renders an empty `<think></think>`). The answer then has no
    reasoning to write."""
    if not getattr(tokenizer, "has_thinking", False) or not prompt:
        return False
    tokens = list(prompt)
    end = tokenizer.rfind_think_end(tokens)
    return end > tokenizer.rfind_think_start(tokens) and not tokenizer.decode(tokens[end + 1:]).strip()


def transitions_for(markers: Markers) -> dict[str, list[tuple[str, str]]]:
    """The state machine's edges: normal -> reasoning -> normal on the think
    markers, normal (and reasoning) -> tool -> normal on the tool markers;
    harmony's channels where the model speaks it."""
    if markers.harmony:
        return harmony_edges(markers.tool is not None)
    edges: dict[str, list[tuple[str, str]]] = {"normal": []}
    if markers.think is not None:
        start, end = markers.think
        edges["normal"].append((start, "reasoning"))
        edges["reasoning"] = [(end, "normal")]
    if markers.tool is not None:
        start, end = markers.tool  # type: ignore[assignment]
        edges["normal"].append((start, "tool"))
        if "reasoning" in edges:
            edges["reasoning"].append((start, "tool"))
        edges["tool"] = [(end, "normal")] if end else []
    return edges


class AnswerSplitter:
    """Feed it the answer's text piece by piece; it returns the parts that
    are safe to send now."""

    def __init__(self, markers: Markers, in_reasoning: bool = False) -> None:
        from mlx_lm.generate import TextStateMachine

        self._sm = TextStateMachine
        machine = TextStateMachine(transitions_for(markers))
        start = "reasoning" if in_reasoning and markers.think is not None else "normal"
        self._state = machine.make_state(start)
        self._call: list[str] = []  # the body of the tool call in progress

    def feed(self, piece: str) -> list[Part]:
        if not piece:
            return []
        self._state, segments = self._sm.split(self._state, piece)
        return self._parts(segments)

    def flush(self) -> list[Part]:
        """The end of the answer: held-back text is released in the state it
        was written in, and an unterminated tool call is still tried as a call."""
        self._state, rest, state = self._sm.flush(self._state)
        parts = self._parts([(state, rest)])
        if self._call:
            body, self._call = "".join(self._call), []
            if body.strip():
                parts.append(Part("tool", body))
        return parts

    def _parts(self, segments: list[tuple[str | None, str]]) -> list[Part]:
        out: list[Part] = []
        last = len(segments) - 1
        for i, (state, text) in enumerate(segments):
            if state == "tool":
                self._call.append(text)
                if i < last:  # the machine left the call: it is complete
                    out.append(Part("tool", "".join(self._call)))
                    self._call = []
            elif text:
                kind: PartKind = "reasoning" if state == "reasoning" else "content"
                if out and out[-1].kind == kind:
                    out[-1] = Part(kind, out[-1].text + text)
                else:
                    out.append(Part(kind, text))
        return out
