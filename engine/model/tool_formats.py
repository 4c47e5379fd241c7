"""How a model writes its tool calls, as far as a grammar can bind them
(pure; no MLX): `ToolFormat` (the markers around a call and the body's
kind), each body kind's newlines (`CallLayout`), the mlx-lm parsers whose
formats are bound and which format a model gets (`tool_format_of`).
engine/model/answer_grammar.py builds an answer's grammar in that format
from engine/model/grammar.py's rules and the bodies of grammar.py,
call_grammars.py and harmony.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CallLayout:
    """Where a format puts newlines around its calls, as Lark expressions ("" for
    none): after the start marker, before the end marker, between two calls,
    after the last one."""

    opened: str
    closing: str
    between: str
    after: str


NEWLINES = CallLayout('"\\n"', '"\\n"', '"\\n"', '"\\n"?')
LAYOUTS = {
    "json": NEWLINES,
    "xml": NEWLINES,
    # No end marker and no separators: `[TOOL_CALLS]a[ARGS]{..}[TOOL_CALLS]b[ARGS]{..}`, as Mistral's templates
    # render calls; the last call runs to the end of the answer.
    "mistral": CallLayout("", "", "", ""),
    # GLM-4.7 writes calls back to back, GLM-4.5 a newline before each: the parser reads either.
    "glm": CallLayout("", "", '"\\n"?', '"\\n"?'),
    "longcat": CallLayout("", "", '"\\n"?', '"\\n"?'),
    # Kimi K2: one section of calls back to back, `<|tool_calls_section_begin|><|tool_call_begin|>...`.
    "kimi": CallLayout("", "", "", ""),
    # Gemma 4 and FunctionGemma: each call in its own markers, back to back.
    "gemma4": CallLayout("", "", "", ""),
    "function_gemma": CallLayout("", "", "", ""),
    # LFM2's `<|tool_call_start|>[a(x=1), b(y=2)]<|tool_call_end|>`: one list, ", " between its calls.
    "pythonic": CallLayout('"["', '"]"', '", "', ""),
    # MiniMax M2: `<minimax:tool_call>\n<invoke ...>\n...</invoke>\n</minimax:tool_call>`.
    "minimax": NEWLINES,
    # gpt-oss's harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
    # one call a turn (`<|call|>` ends it); engine/model/harmony.py.
    "harmony": CallLayout("", "", "", ""),
}


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a tool call: `start`, the body, `end` (empty where
    a call runs to the end of the answer), with the body kind's newlines
    (`layout`). `body` "json": `\\n{"name": ..., "arguments": {...}}\\n`
    (Hermes / Qwen's format, which mlx-lm's json_tools parser reads, and the
    one mlxd renders for a template without tools); "xml": Qwen3-Coder's
    `<function=NAME>` with a `<parameter=NAME>` block per argument (its
    qwen3_coder parser); "mistral": `NAME[ARGS]{arguments}` after
    `[TOOL_CALLS]`, no end marker (mistral parser); "glm": `NAME` then
    `<arg_key>K</arg_key><arg_value>V</arg_value>` per argument (GLM-4.5 /
    4.7, glm47 parser); "longcat": the same with `<longcat_arg_key>` tags;
    "kimi", "gemma4", "function_gemma", "pythonic", "minimax": those mlx-lm
    parsers' formats (engine/model/call_grammars.py); "harmony": gpt-oss's
    (engine/model/harmony.py). `source`: "template" (the model's own) or "mlxd"."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    source: str = "template"
    body: str = "json"

    @property
    def layout(self) -> CallLayout:
        return LAYOUTS[self.body]


# mlx-lm's tool parsers whose calls a grammar can bind here, and their bodies (and mlx-vlm's harmony parser,
# for gpt-oss, which mlx-lm has none for).
BOUND_PARSERS = {"mlx_lm.tool_parsers.json_tools": "json", "mlx_lm.tool_parsers.qwen3_coder": "xml",
                 "mlx_lm.tool_parsers.mistral": "mistral", "mlx_lm.tool_parsers.glm47": "glm",
                 "mlx_lm.tool_parsers.longcat": "longcat", "mlx_lm.tool_parsers.kimi_k2": "kimi",
                 "mlx_lm.tool_parsers.gemma4": "gemma4", "mlx_lm.tool_parsers.function_gemma": "function_gemma",
                 "mlx_lm.tool_parsers.pythonic": "pythonic", "mlx_lm.tool_parsers.minimax_m2": "minimax",
                 "mlx_vlm.tools.parsers.harmony": "harmony"}
ENDLESS_BODIES = frozenset({"mistral"})  # bodies whose parser reads a call to the end of the answer (no end marker)
# Bodies whose markers hold all of an answer's calls (`<|tool_calls_section_begin|>` ... `_end|>`): several
# calls go inside one pair of markers, `between` apart.
SECTION_BODIES = frozenset({"kimi", "pythonic", "minimax"})
ONE_CALL_BODIES = frozenset({"harmony"})  # a call ends the model's turn: one call an answer
UNBOUND_FORMAT = ("this model's tool-call format cannot be bound by mlxd; bound are mlx-lm's json_tools (Qwen, "
                  "Hermes), qwen3_coder, mistral, glm47, longcat, kimi_k2, gemma4, function_gemma, pythonic "
                  "(LFM2) and minimax_m2 formats and gpt-oss's harmony, not yet MiniCPM, Kimi K3, Laguna, "
                  "Muse Spark or others")
MLXD_TOOL_FORMAT = ToolFormat(source="mlxd")


def tool_format_of(parser_module: str | None, start: str | None, end: str | None,
                   renders_tools: bool) -> ToolFormat | None:
    """The tool-call format a grammar can bind for this model (pure): mlxd's
    own where the chat template does not render tools, the model's where its
    parser is one of BOUND_PARSERS, else None (its format is not one we can bind)."""
    if not renders_tools:
        return MLXD_TOOL_FORMAT
    body = BOUND_PARSERS.get(parser_module or "")
    if body and start and (end or body in ENDLESS_BODIES):
        return ToolFormat(start, end or "", "template", body)
    return None
