"""gpt-oss's harmony format: its channels split, its calls bound (pure; no MLX).

gpt-oss answers in messages of channels, after the prompt's
`<|start|>assistant` (its own chat template renders the prompt, tools
included, in harmony):

    <|channel|>analysis<|message|>reasoning<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

and calls a tool in the commentary channel, naming it as the recipient:

    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(or with the recipient in the header: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`).
`<|call|>` and `<|return|>` end the turn (they are among its end tokens).

mlx-lm knows none of it (no thinking markers, no tool parser for gpt-oss);
mlx-vlm has a parser for the call's body (mlx_vlm.tools.parsers.harmony),
used here. `harmony_edges` are the channels as the answer splitter's
transitions (engine/model/answer_parts.py): analysis is reasoning, final and
plain commentary are content, a commentary to a function is a call, the
headers and end tokens are dropped. `harmony_grammar` binds an answer.
"""

from __future__ import annotations

from typing import Any

from .grammar import Literal_, OutputRules, ToolSpec, _check_name, json_rule, quoted, spelled, think_rules
from .tool_formats import ToolFormat

CALL_START = "<|channel|>commentary to="  # mlx-vlm's harmony parser's markers
CALL_END = "<|call|>"
NEXT_MESSAGE = "<|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|channel|>final<|message|>"
PREAMBLE = "<|channel|>commentary<|message|>"  # commentary to nobody: text the user sees
ENDS = ("<|end|>", "<|return|>")
HARMONY_PARSER = "mlx_vlm.tools.parsers.harmony"


def is_harmony(tokenizer: Any) -> bool:
    """Whether the model speaks harmony: its chat template writes channels
    (as mlx-vlm's parser registry tells gpt-oss)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "<|channel|>" in template and "<|message|>" in template


def harmony_edges(tools: bool) -> dict[str, list[tuple[str, str]]]:
    """The answer splitter's transitions for harmony. Each header is matched
    whole, with and without the `<|start|>assistant` that opens every message
    but the first (mlx-lm's matcher fires on the first marker that completes,
    so no marker may end inside another)."""
    normal: list[tuple[str, str]] = []
    for opened in ("", NEXT_MESSAGE):
        normal += [(opened + ANALYSIS, "reasoning"), (opened + FINAL, "normal"), (opened + PREAMBLE, "normal")]
        if tools:
            normal.append((opened + CALL_START, "tool"))
    if tools:
        normal.append((NEXT_MESSAGE + " to=", "tool"))  # the recipient in the role's header
    normal += [(end, "normal") for end in ENDS]
    edges = {"normal": normal, "reasoning": [(end, "normal") for end in ENDS]}
    if tools:
        edges["tool"] = [(CALL_END, "normal")]
    return edges


def harmony_body(tools: tuple[ToolSpec, ...], literal: Literal_) -> list[str]:
    """After `<|channel|>commentary to=`: `functions.NAME <|constrain|>json<|message|>{arguments}`;
    the parser reads the name up to a space or `<`, the arguments as JSON."""
    lines = ["call_body: " + " | ".join(f"harmony_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        _check_name(tool.name, r"[^\s<|]+", "gpt-oss")
        lines.append(f"harmony_{i}_args: {json_rule(tool.parameters)}")
        lines.append(f"harmony_{i}: {quoted('functions.' + tool.name + ' ')} "
                     f"{spelled('<|constrain|>json<|message|>', literal)} harmony_{i}_args")
    return lines


def harmony_grammar(rules: OutputRules, fmt: ToolFormat, literal: Literal_, think_budget: int | None = None) -> str:
    """The Lark grammar of a bound harmony answer: reasoning in the analysis
    channel first (free, and optional), then the call (one: `<|call|>` ends
    the turn), or the final channel's JSON answer or text."""
    next_message = spelled(NEXT_MESSAGE, literal)
    end = literal(ENDS[0])
    lines = ["%llguidance {}", "",
             *think_rules(end, think_budget),
             f"analysis: {spelled(ANALYSIS, literal)} think {next_message}",
             f"call: {spelled(fmt.start, literal)} call_body {spelled(fmt.end, literal)}",
             f"final: {spelled(FINAL, literal)}"]
    lines += harmony_body(rules.forced_tools(), literal)
    may_call = rules.tools and rules.tool_choice != "none"
    if rules.forces_tool:
        answer = "call"
    elif rules.schema is not None:
        lines.append("json_answer: " + json_rule(rules.schema))
        answer = "(final json_answer" + (" | call)" if may_call else ")")
    else:  # "none" (no call) or strict tools under "auto" (a call, bound, or text)
        lines.append("TEXT: /(?s:.*)/")
        answer = "(final TEXT" + (" | call)" if may_call else ")")
    lines[1] = f"start: analysis? {answer}"
    return "\n".join(lines) + "\n"


def parse_harmony_call(text: str, tools: Any = None) -> dict[str, Any]:
    """One call's body (after `<|channel|>commentary to=` or `<|start|>assistant to=`),
    read by mlx-vlm's harmony parser."""
    from mlx_vlm.tools.parsers.harmony import parse_tool_call

    return parse_tool_call(text, tools)
