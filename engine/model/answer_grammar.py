"""An answer's grammar (pure; no MLX): a request's `OutputRules` and the
model's call format as one Lark grammar for llguidance (engine/model/grammar.py
says why llguidance), its call bodies from every format's rules — mlx-lm's
JSON, XML and argument-tag formats (grammar.py), Kimi K2, Gemma 4,
FunctionGemma, pythonic and MiniMax (call_grammars.py), gpt-oss's harmony
(harmony.py). It stands above all three, which build on grammar.py's rules.
"""

from __future__ import annotations

from . import call_grammars, harmony
from .grammar import (BODY_RULES, MAX_PARALLEL_CALLS, GrammarUnsupported, Literal_, OutputRules, ToolSpec, _lazy,
                      _regex_escape, _seq, json_rule, quoted, spelled, think_rules)
from .harmony import harmony_grammar
from .tool_formats import ONE_CALL_BODIES, SECTION_BODIES, UNBOUND_FORMAT, ToolFormat


def call_body_rules(tools: tuple[ToolSpec, ...], fmt: ToolFormat, literal: Literal_ = quoted) -> list[str]:
    """The rules of `call_body`: one call of one of `tools` in the format's body."""
    if fmt.body not in BODY_RULES:  # the later formats' bodies (call_grammars.py, harmony.py: on grammar.py's rules)
        more = {"kimi": call_grammars.kimi_body, "gemma4": call_grammars.gemma4_body,
                "function_gemma": call_grammars.function_gemma_body, "pythonic": call_grammars.pythonic_body,
                "minimax": call_grammars.minimax_body, "harmony": harmony.harmony_body}
        return more[fmt.body](tools, literal)
    return BODY_RULES[fmt.body](tools, literal)


def reasoning_budget(max_tokens: int) -> int:
    """The most tokens a bound harmony answer's analysis may take (pure):
    half the answer's max_tokens, so that the call or JSON it must end in
    always has room -- a model that reasons to max_tokens would otherwise end
    with no call at all (a random-weight or looping model never closes it)."""
    return max(1, max_tokens // 2)


def answer_grammar(rules: OutputRules, tool_format: ToolFormat | None, think_end: str | None = None,
                   in_reasoning: bool = False, think_start: str | None = None,
                   literal: Literal_ = quoted, think_budget: int | None = None) -> str | None:
    """The Lark grammar (llguidance's dialect) the answer must follow, or
    None for free text (pure). `think_end`: the model's end-of-reasoning
    marker where it reasons (the grammar lets it think first, freely; a
    harmony model's analysis channel for at most `think_budget` tokens);
    `in_reasoning`: the prompt already opened the block. `literal` writes a
    marker (a special token must be named by id, not spelled as text)."""
    if not rules.constrained:
        return None
    if rules.tool_choice == "none" and rules.schema is None and tool_format is None:
        return None  # a call format we do not know cannot be excluded; the answer is not parsed for calls either
    if rules.tool_choice != "none" and rules.tools and (rules.forces_tool or any(t.strict for t in rules.tools)):
        if tool_format is None:
            raise GrammarUnsupported(UNBOUND_FORMAT)
    if tool_format is not None and tool_format.body == "harmony":  # channels, not think tags
        return harmony_grammar(rules, tool_format, literal, think_budget)
    lines = ["%llguidance {}"]
    body = _body_rules(rules, tool_format, literal, lines)
    if think_end is not None and (in_reasoning or think_start is not None):
        # No budget here: a think block's text before a special-token end, capped, changed how the answer after it
        # was lexed (test_agent_round_trip's JSON after reasoning became newlines); only harmony's is capped.
        lines += think_rules(literal(think_end), None)
        if in_reasoning:
            lines.insert(1, f"start: think WS? {body}")
        else:  # the model may open a block of its own first
            lines.insert(1, f"start: ({literal(think_start)} think WS?)? {body}")  # type: ignore[arg-type]
        lines.append("WS: /[ \\t\\n]+/")
    else:
        lines.insert(1, f"start: {body}")
    return "\n".join(lines) + "\n"


def _body_rules(rules: OutputRules, fmt: ToolFormat | None, literal: Literal_, lines: list[str]) -> str:
    """Adds the answer's rules to `lines`; returns the expression of the answer itself."""
    def call_rule() -> str:
        assert fmt is not None
        # A named function is called once (as OpenAI's API answers it); "required" allows several unless
        # parallel_tool_calls is false. Between several calls a newline may end the answer, so that a model
        # that writes one after a call is not forced into another call by it.
        # Several calls are capped: a small model may repeat its call until max_tokens (the default model does).
        one = (not rules.parallel_tool_calls or rules.tool_choice not in ("required", "auto")
               or fmt.body in ONE_CALL_BODIES)
        calls = "call_body"
        if fmt.body in SECTION_BODIES and not one:  # several calls inside the one pair of markers
            calls = f"call_body ({_seq(fmt.layout.between, 'call_body')}){{0,{MAX_PARALLEL_CALLS - 1}}}"
        lines.append("call: " + _seq(spelled(fmt.start, literal), fmt.layout.opened, calls, fmt.layout.closing,
                                     _end(fmt, literal)))
        lines.extend(call_body_rules(rules.forced_tools(), fmt, literal))
        return "call" if one or fmt.body in SECTION_BODIES else _seq("call", more_calls(), fmt.layout.after)

    def more_calls() -> str:
        assert fmt is not None
        return f"({_seq(fmt.layout.between, 'call')}){{0,{MAX_PARALLEL_CALLS - 1}}}"

    if rules.forces_tool:
        return call_rule()
    if rules.schema is not None:
        lines.append("json_answer: " + json_rule(rules.schema))
        if rules.tools and rules.tool_choice != "none" and fmt is not None:
            return f"(json_answer | {call_rule()})"  # the model may call a tool instead of answering
        return "json_answer"
    if rules.tool_choice == "none":  # free text that never opens a call
        assert fmt is not None
        start = spelled(fmt.start, literal)
        if start.startswith('"'):  # text: excluded from the text (a special token never matches text anyway)
            lines.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*{_regex_escape(fmt.start)}.*)/")
        else:
            lines.append("TEXT: /(?s:.*)/")
        return "TEXT"
    # only strict tools under "auto": free text until the model opens a call
    # (a lazy lexeme ends at the first start marker), then the call is bound
    assert fmt is not None
    lines.append("TEXT: /(.|\\n)*/")
    lines.append(f"call_opened{_lazy(literal(fmt.start))}: TEXT {spelled(fmt.start, literal)}")
    calls = "call_body"
    if fmt.body in SECTION_BODIES and rules.parallel_tool_calls:
        calls = f"call_body ({_seq(fmt.layout.between, 'call_body')}){{0,{MAX_PARALLEL_CALLS - 1}}}"
    lines.append("bound_call: " + _seq("call_opened", fmt.layout.opened, calls, fmt.layout.closing,
                                       _end(fmt, literal)))
    if fmt.end or not rules.parallel_tool_calls:
        lines.extend(call_body_rules(rules.forced_tools(), fmt, literal))
        return "bound_call* TEXT" if rules.parallel_tool_calls else "(bound_call | TEXT)"
    # No end marker: text after a call would be read as part of it, so only further calls may follow.
    call_rule()
    return f"(bound_call {more_calls()} | TEXT)"


def _end(fmt: ToolFormat, literal: Literal_) -> str:
    """The end marker as a Lark literal; nothing where the format has none."""
    return spelled(fmt.end, literal) if fmt.end else ""
