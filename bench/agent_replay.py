"""Agent replay benchmark: the prompt cache against the prompts real agents send.

Agents resend the whole conversation every turn, but not always byte for
byte: Claude Code puts a per-request hash on the system prompt's first line,
others stamp the time into it, inject a changing `<system-reminder>`, clear
old tool results, or run sub-agents beside the main conversation; reasoning
models' templates drop the earlier `<think>` blocks. Exact prefix reuse stops
at the first token that differs. This replays scripted conversations of each
kind THROUGH THE GATEWAY of a real stack (devkit's Stack: `mlxd up --detach`
in a throw-away home) and reports per turn the prompt tokens, the cached
tokens the engine reported, the exact-prefix bound and the TTFT.

Kinds (--kinds; each on the OpenAI route, `openai` client, chat.completions;
--anthropic-kinds also on the Anthropic route, `/v1/messages` with the
`anthropic` client):

  clean                a plain multi-turn conversation (the baseline)
  claude_code          `x-anthropic-billing-header: cc_version=…; cch=<5 hex, new every
                       request>;` as the system prompt's first line (on the Anthropic
                       route its own first system block, as Claude Code sends it)
  clock                `Current time is 2026-11-25 10:42:13`, advancing each turn, in
                       the middle of the system prompt
  system_reminder      each new user message starts with a `<system-reminder>` whose
                       text changes every turn; earlier messages go back as sent
  subagents            an orchestrator and two sub-agents (same system prompt up to
                       their task), interleaved turn by turn
  edited_tool_results  assistant tool calls and tool results; from the middle turn on
                       the first tool result is "[Old tool result content cleared]"
                       (Claude Code's micro-compaction)
  reasoning            the demo model `think` (or --model when its template has think
                       markers) with thinking on: the reasoning is not sent back

Arms (--arms), alternating per round (--rounds), one server per arm and round,
every kind run on it in turn:

  cache    mlxd with its prompt cache as configured by default
  approx   mlxd with `[engine.prompt_cache] approximate = true` (skipped with a
           note where the config refuses the key)
  nocache  mlxd with `[engine.prompt_cache] enabled = false`: every turn cold. The
           anchor of the TTFT ratio; a cold turn costs a whole prefill, so by
           default it runs --nocache-kinds (claude_code) only, for --nocache-turns
           (4) turns: the ratio is over turns 2-4
  mlx_lm   `python -m mlx_lm server` on the same model, straight to it (it has
           no /v1/messages), with its own prompt cache; it reports cached tokens
           in usage (prompt_tokens_details.cached_tokens)

The exact-prefix bound of a turn is computed here with the model's tokenizer:
its prompt rendered as the engine renders it (chat template with the tools,
generation prompt; the Claude Code header removed where the server removes it:
mlxd's `[engine] strip_metadata`, on unless --keep-metadata; mlx_lm.server
never) against each earlier request to that server (every kind's: they share
a template's opening tokens, and Claude Code's header where it is kept)
followed by its answer's tokens (the returned text re-tokenized, reasoning
inside its think markers): the longest common prefix, at most the prompt's
length - 1 (the last token is always prefilled). The engine does not reuse
less than 32 shared tokens (MIN_REUSE_TOKENS); the bound ignores that. An
approximate cache can exceed the bound. The demo models' random weights
often write token sequences that their text does not re-tokenize to; then
the engine's entry stops at the earlier prompt's end while the bound also
counts the answer (the engine's own account of each turn, /health's
`prompt_cache.recent`, is kept in the JSON as `engine_reuse`).

On the Anthropic route LiteLLM reports Anthropic's usage: `input_tokens` are
the tokens NOT read from cache, `cache_read_input_tokens` the engine's
cached_tokens (left out when 0), both in the `message_delta` event
(`message_start` carries zeros); prompt tokens = their sum.

  .venv/bin/python bench/agent_replay.py --quick        # ~2-3 min on 2 CPU cores
  .venv/bin/python bench/agent_replay.py                # demo model a, ~1500-token system prompt, 8 turns: ~10 min
  .venv/bin/python bench/agent_replay.py --model PATH --system-tokens 3700 --nocache-kinds all --nocache-turns 0
  .venv/bin/python bench/agent_replay.py --arms cache,approx --kinds clock,subagents --rounds 3

Results: bench/results/agent_replay/agent_replay.md and .json (--out-dir):
every turn, the memory tier's entries after each kind (engine /health,
`prompt_cache.memory_entries`: over a replay it should hold one entry per
live conversation), and the claude_code turns' TTFT with the cache over
without it (goal <= 0.1x).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py, tests)
from benchkit import (RESULTS, Server, child_env, demo_model, interrupt_on_sigterm,  # noqa: E402
                      machine_info, say, spawn, stop_all_children, stop_child, write_json)

from mlxd.devkit.ports import free_port  # noqa: E402
from mlxd.toml_text import dumps  # noqa: E402

KINDS = ("clean", "claude_code", "clock", "system_reminder", "subagents", "edited_tool_results", "reasoning")
ARMS = ("cache", "approx", "nocache", "mlx_lm")
ROUTES = ("openai", "anthropic")
# What each mlxd arm sets in [engine.prompt_cache]; "approx" is the opt-in approximate reuse.
ARM_CACHE = {"cache": {}, "approx": {"approximate": True}, "nocache": {"enabled": False}}
# Large prompts on a slow CPU: no token caps in the way, no long prefill mistaken for a hang.
ENGINE = {"max_tokens_cap": 100000, "max_prompt_tokens": 131072, "stuck_grace_s": 600, "context_tokens": 32768}

BILLING_HEADER = "x-anthropic-billing-header: cc_version=2.1.120.cf9; cc_entrypoint=cli; cch={cch};"
CLEARED = "[Old tool result content cleared]"
CLOCK_START = dt.datetime(2026, 11, 25, 10, 42, 13)
SUBAGENTS = {"orchestrator": "You are the orchestrator: plan the change, hand parts of it to sub-agents, "
                             "and merge their findings.",
             "subagent-1": "You are sub-agent 1: find every caller of the cache's fetch function and report "
                           "how each one uses the result.",
             "subagent-2": "You are sub-agent 2: read the tests of the prompt cache and list what they do not "
                           "cover yet."}
FILES = ("engine/core/worker.py", "engine/cache/prompt_cache.py", "core/config.py", "gateway/main.py", "engine/api/server.py",
         "tests/engine/test_worker.py", "docs/DESIGN.md", "supervisor/listener.py", "engine/core/jobs.py")
ASKS = ("what the main loop does", "where the cache is filled", "which settings it reads", "how errors reach the "
        "client", "what happens on shutdown", "which cases are tested", "why it is built this way",
        "when it restarts the engine", "how a request becomes a job")
# The tools every request declares, terse (the template's preamble and each tool's JSON cost
# ~370 tokens on the demo tokenizer); the system prompt's text holds the bulk of the schemas.
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a workspace file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
]
TOOL_WORDS = ("path", "query", "limit", "recursive", "encoding", "timeout", "branch", "message", "pattern", "lines")


# --- the conversations (pure) ------------------------------------------------------------

def system_prompt(n_tokens: int, salt: str, count: Callable[[str], int]) -> str:
    """A system prompt of about `n_tokens` (as `count` counts them): rules, then
    tool schemas in its text, one short one per line, as agent frameworks write them."""
    # The salt first: prompts of different salts share only the template's opening tokens.
    lines = [f"[{salt}] You are a coding agent. Work in the user's repository with the tools; answer tersely.",
             "Read before you edit. Run the tests after a change. Never invent file contents.", "# Tools"]
    i = 0
    while count("\n".join(lines)) < n_tokens:
        words = [TOOL_WORDS[(i + j) % len(TOOL_WORDS)] for j in range(3)]
        props = {w: {"type": "string", "description": f"The {w} of operation {i} (manual {i}.{j})."}
                 for j, w in enumerate(words)}
        lines.append(json.dumps({"name": f"workspace_op_{i}", "description": f"Operation {i} of the workspace.",
                                 "parameters": {"type": "object", "properties": props}}))
        i += 1
    return "\n".join(lines)


def billing_header(cch: str) -> str:
    return BILLING_HEADER.format(cch=cch)


def is_metadata(block: str) -> bool:
    """A system block that is Claude Code's billing header (what mlxd strips)."""
    return block.startswith("x-anthropic-billing-header:")


def system_text(blocks: Sequence[str], strip_metadata: bool, sep: str = "\n") -> str:
    """The system prompt as one string: blocks joined by a newline (how Claude
    Code's header reaches an OpenAI-style server; `sep` "" for the Anthropic
    route's blocks, which LiteLLM hands on as content parts that the template
    joins as they are), the header left out where the server strips it (the
    engine also drops the newline after it)."""
    return sep.join(b for b in blocks if not (strip_metadata and is_metadata(b)))


def clock_line(turn: int) -> str:
    """The clock of turn `turn`: same width every turn, 97 s later each."""
    return f"Current time is {CLOCK_START + dt.timedelta(seconds=97 * (turn - 1)):%Y-%m-%d %H:%M:%S}"


def with_line_in_middle(text: str, line: str) -> str:
    """`line` inserted at the line break nearest the middle of `text`."""
    breaks = [i for i, c in enumerate(text) if c == "\n"] or [len(text)]
    at = min(breaks, key=lambda i: abs(i - len(text) // 2))
    return text[:at] + "\n" + line + text[at:]


def reminder(turn: int, turns: int) -> str:
    """A `<system-reminder>` whose state changes every turn (a todo list)."""
    done = turn - 1
    when = (CLOCK_START + dt.timedelta(seconds=61 * turn)).strftime("%H:%M:%S")
    return (f"<system-reminder>\nThe todo list has {done} of {turns + 1} items done (last change {when}); "
            f"the next one is item {done + 1}. Keep it up to date; do not mention this reminder.\n</system-reminder>\n")


def tool_result(turn: int, n_lines: int = 6) -> str:
    """A file's contents as a read_file result (different every turn)."""
    path = FILES[turn % len(FILES)]
    body = "\n".join(f"{k + 1:4d}  def step_{turn}_{k}(x):  # {path}, part {k}: returns x + {k * turn}"
                     for k in range(n_lines))
    return f"{path} ({n_lines} lines)\n{body}"


@dataclass
class Request:
    """One request of a scripted conversation, route-neutral (OpenAI shapes)."""

    kind: str
    conversation: str
    turn: int
    system: list[str]  # system text blocks in order (Claude Code's header its own first block)
    messages: list[dict]  # the messages after the system prompt, as sent this turn
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict] = field(default_factory=lambda: TOOLS)

    def openai_messages(self, strip_metadata: bool = False, sep: str = "\n") -> list[dict]:
        return [{"role": "system", "content": system_text(self.system, strip_metadata, sep)}] + self.messages


class Script:
    """One kind's conversations, turn by turn: `order()` lists (conversation,
    turn) in sending order; `request()` gives a turn's request; `answer()`
    puts what came back into that conversation's history, as the agent would."""

    def __init__(self, kind: str, system: str, turns: int, seed: int = 0) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
        self.kind, self.base, self.turns = kind, system, turns
        # seeded by the prompt too: Claude Code's hashes are new on every route and in every kind
        self.rng = random.Random(f"{kind}/{seed}/{system[:80]}")
        self.history: dict[str, list[dict]] = {name: [] for name in (SUBAGENTS if kind == "subagents" else ["main"])}
        # Micro-compaction clears the first tool result from the middle turn on (turn 3 at
        # the earliest: the result went back in full at least once before).
        self.clear_turn = max(3, turns // 2 + 1)

    def order(self) -> list[tuple[str, int]]:
        return [(name, t) for t in range(1, self.turns + 1) for name in self.history]

    def system_blocks(self, conversation: str, turn: int) -> list[str]:
        if self.kind == "claude_code":  # a new hash every request
            return [billing_header("".join(self.rng.choice("0123456789abcdef") for _ in range(5))), self.base]
        if self.kind == "clock":
            return [with_line_in_middle(self.base, clock_line(turn))]
        if self.kind == "subagents":  # the same prompt up to the task
            return [f"{self.base}\n# Your task\n{SUBAGENTS[conversation]}"]
        return [self.base]

    def user_text(self, conversation: str, turn: int) -> str | None:
        """The turn's new user message (None: the turn only carries a tool result back)."""
        ask = f"Step {turn}: open {FILES[turn % len(FILES)]} and tell me {ASKS[turn % len(ASKS)]}."
        if self.kind == "edited_tool_results":
            return "Find out how the engine's prompt cache is filled; read the files you need." if turn == 1 else None
        if self.kind == "system_reminder":
            return reminder(turn, self.turns) + ask
        if self.kind == "subagents":
            return f"[{conversation}] {ask}"
        return ask

    def request(self, conversation: str, turn: int) -> Request:
        history = self.history[conversation]
        if self.kind == "edited_tool_results" and turn >= self.clear_turn:
            first_tool = next((m for m in history if m["role"] == "tool"), None)
            if first_tool is not None:
                first_tool["content"] = CLEARED
        text = self.user_text(conversation, turn)
        if text is not None:
            history.append({"role": "user", "content": text})
        kwargs = {"enable_thinking": True} if self.kind == "reasoning" else {}
        return Request(self.kind, conversation, turn, self.system_blocks(conversation, turn),
                       copy.deepcopy(history), kwargs)

    def answer(self, req: Request, content: str) -> None:
        """The assistant message goes back with its content only (a reasoning
        model's reasoning is not sent back); in edited_tool_results with a tool
        call and its result after it."""
        msg: dict[str, Any] = {"role": "assistant", "content": content or "(no output)"}
        history = self.history[req.conversation]
        history.append(msg)
        if self.kind == "edited_tool_results":
            call_id = f"call_{req.turn:02d}{self.rng.randrange(16 ** 6):06x}"
            path = FILES[req.turn % len(FILES)]
            msg["tool_calls"] = [{"id": call_id, "type": "function",
                                  "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}]
            history.append({"role": "tool", "tool_call_id": call_id, "content": tool_result(req.turn)})


def anthropic_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped plain text turns as Anthropic Messages (the kinds sent on
    that route have no tool messages)."""
    out = []
    for m in messages:
        if m["role"] not in ("user", "assistant") or not isinstance(m["content"], str) or m.get("tool_calls"):
            raise ValueError(f"only plain user/assistant text goes on the Anthropic route here, not {m['role']!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def anthropic_tools(tools: list[dict]) -> list[dict]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in tools]


# --- the exact-prefix bound (pure) -------------------------------------------------------

def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def exact_prefix_bound(prompt: Sequence[int], earlier: Iterable[Sequence[int]]) -> int:
    """The most prompt tokens exact prefix reuse can serve: the longest common
    prefix with any earlier request's prompt + answer tokens, leaving the
    prompt's last token to prefill (its logits start the answer)."""
    best = max((common_prefix(prompt, seq) for seq in earlier), default=0)
    return max(0, min(best, len(prompt) - 1))


def generated_text(content: str, reasoning: str, opened_in_prompt: bool,
                   think: tuple[str, str] = ("<think>", "</think>")) -> str:
    """What the model wrote, as text: the reasoning inside its markers (the
    opening one already in the prompt where the template opened the block),
    then the content. Whitespace around the markers is the model's and not
    known here; the next prompt parts from it at the reasoning anyway."""
    if not reasoning:
        return content
    # no content: the answer was cut off inside the reasoning (max_tokens), before its end marker
    return ("" if opened_in_prompt else think[0]) + reasoning + (think[1] + content if content else "")


class Bounds:
    """Earlier requests to one server: their prompt + answer tokens."""

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []

    def bound(self, prompt: Sequence[int]) -> int:
        return exact_prefix_bound(prompt, self.seqs)

    def add(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        self.seqs.append(list(prompt) + list(answer))


# --- summaries (pure) ------------------------------------------------------------------------

def share(part: int | None, whole: int | None) -> float | None:
    return None if part is None or not whole else part / whole


def _stats(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (kind, route, arm), in the order first seen: turn 1's TTFT;
    turn 2's cached share, bound share and TTFT; turns 3-N's shares (median,
    min, max) and median TTFT. Rows with an error are left out; a cached share
    is None where the server reported no cached tokens."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        if not r.get("error"):
            groups.setdefault((r["kind"], r["route"], r["arm"]), []).append(r)
    out = []
    for (kind, route, arm), rs in groups.items():
        def pick(sel: Callable[[dict], bool], key: str) -> list[float]:
            vals = []
            for r in rs:
                if not sel(r):
                    continue
                v = (share(r["cached_tokens"], r["prompt_tokens"]) if key == "cached" else
                     share(r["bound_tokens"], r["bound_prompt_tokens"]) if key == "bound" else r["ttft_s"] * 1000)
                if v is not None:
                    vals.append(v)
            return vals

        def med(vals: list[float]) -> float | None:
            return statistics.median(vals) if vals else None

        first, second, later = (lambda r: r["turn"] == 1), (lambda r: r["turn"] == 2), (lambda r: r["turn"] >= 3)
        out.append({"kind": kind, "route": route, "arm": arm, "turns": max(r["turn"] for r in rs),
                    "requests": len(rs),
                    "turn1_ttft_ms": med(pick(first, "ttft")),
                    "turn2_cached": med(pick(second, "cached")), "turn2_bound": med(pick(second, "bound")),
                    "turn2_ttft_ms": med(pick(second, "ttft")),
                    "later_cached": _stats(pick(later, "cached")), "later_bound": _stats(pick(later, "bound")),
                    "later_ttft_ms": med(pick(later, "ttft"))})
    return out


def ttft_ratio(rows: list[dict], kind: str, route: str, arm: str = "cache", anchor: str = "nocache",
               from_turn: int = 2) -> dict[str, Any] | None:
    """`arm`'s TTFT over `anchor`'s on the same turns (from `from_turn`):
    median over rounds per turn, then the median of the per-turn ratios."""
    def per_turn(a: str) -> dict[tuple[str, int], float]:
        by: dict[tuple[str, int], list[float]] = {}
        for r in rows:
            if (r["kind"], r["route"], r["arm"]) == (kind, route, a) and r["turn"] >= from_turn and not r.get("error"):
                by.setdefault((r["conversation"], r["turn"]), []).append(r["ttft_s"])
        return {k: statistics.median(v) for k, v in by.items()}

    mine, cold = per_turn(arm), per_turn(anchor)
    pairs = sorted(set(mine) & set(cold))
    if not pairs:
        return None
    ratios = [mine[k] / cold[k] for k in pairs]
    return {"kind": kind, "route": route, "arm": arm, "anchor": anchor, "turns": [t for _, t in pairs],
            "ratio": statistics.median(ratios), "ratios": ratios,
            "arm_ttft_ms": statistics.median(mine[k] for k in pairs) * 1000,
            "anchor_ttft_ms": statistics.median(cold[k] for k in pairs) * 1000}


def answers_agree(rows: list[dict], arm: str, anchor: str) -> dict[str, Any] | None:
    """Whether `arm` answered every turn that `anchor` also answered (same
    kind, route, conversation, turn, round) with the same text (pure): with
    greedy decoding the exact prompt cache must not change an answer."""
    def answers(a: str) -> dict[tuple, str]:
        return {(r["kind"], r["route"], r["conversation"], r["turn"], r["round"]): r.get("content", "")
                for r in rows if r["arm"] == a and not r.get("error")}

    mine, other = answers(arm), answers(anchor)
    both = sorted(set(mine) & set(other))
    if not both:
        return None
    differ = [k for k in both if mine[k] != other[k]]
    return {"arm": arm, "anchor": anchor, "compared": len(both), "identical": len(both) - len(differ),
            "differ": [list(k) for k in differ]}


def memory_by_group(memory: list[dict]) -> dict[tuple[str, str, str], tuple[float, float]]:
    """(kind, route, arm) -> median over rounds of (entries after the kind, change over the kind)."""
    by: dict[tuple[str, str, str], list[dict]] = {}
    for m in memory:
        by.setdefault((m["kind"], m["route"], m["arm"]), []).append(m)
    return {k: (statistics.median(m["entries"] for m in v), statistics.median(m["delta"] for m in v))
            for k, v in by.items()}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.1f} %"


def _pct_range(s: dict[str, float] | None) -> str:
    return "—" if s is None else f"{s['median'] * 100:.1f} % ({s['min'] * 100:.1f}–{s['max'] * 100:.1f})"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def _num(x: float) -> str:
    return f"{x:g}"


def markdown_table(summary: list[dict], memory: dict[tuple[str, str, str], tuple[float, float]]) -> str:
    lines = ["| kind | route | arm | turn 1 TTFT ms | turn 2 cached | turn 2 bound | turn 2 TTFT ms "
             "| turns 3–N cached | turns 3–N bound | turns 3–N TTFT ms | memory entries (Δ) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        mem = memory.get((s["kind"], s["route"], s["arm"]))
        mem_cell = "—" if mem is None else f"{_num(mem[0])} ({mem[1]:+g})"
        lines.append(f"| {s['kind']} | {s['route']} | {s['arm']} | {_ms(s['turn1_ttft_ms'])} | "
                     f"{_pct(s['turn2_cached'])} | {_pct(s['turn2_bound'])} | {_ms(s['turn2_ttft_ms'])} | "
                     f"{_pct_range(s['later_cached'])} | {_pct_range(s['later_bound'])} | "
                     f"{_ms(s['later_ttft_ms'])} | {mem_cell} |")
    return "\n".join(lines)


# --- talking to the servers ------------------------------------------------------------------

@dataclass
class Reply:
    ttft_s: float
    total_s: float
    content: str
    reasoning: str
    prompt_tokens: int | None
    cached_tokens: int | None  # None: the server reported none
    completion_tokens: int | None
    usage: dict[str, Any]


class OpenAIRoute:
    """Streamed chat completions with the `openai` client."""

    name = "openai"

    def __init__(self, base_url: str, key: str, max_tokens: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=1800)
        self.max_tokens = max_tokens

    def send(self, req: Request, model: str) -> Reply:
        extra = {"chat_template_kwargs": req.template_kwargs} if req.template_kwargs else None
        t0 = time.perf_counter()
        first = None
        content, reasoning, usage = [], [], None
        stream = self.client.chat.completions.create(
            model=model, messages=req.openai_messages(), max_tokens=self.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra, **({"tools": req.tools} if req.tools else {}))
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices or []:
                delta = choice.delta
                extras = delta.model_extra or {}
                think = extras.get("reasoning_content") or extras.get("reasoning") or ""
                if (delta.content or think) and first is None:
                    first = time.perf_counter()
                content.append(delta.content or "")
                reasoning.append(think)
        end = time.perf_counter()
        u = usage.model_dump() if usage is not None else {}
        details = u.get("prompt_tokens_details") or {}
        return Reply((first or end) - t0, end - t0, "".join(content), "".join(reasoning), u.get("prompt_tokens"),
                     details.get("cached_tokens"), u.get("completion_tokens"), u)


class AnthropicRoute:
    """Streamed Messages with the `anthropic` client, system as text blocks
    (Claude Code's billing header its own first block)."""

    name = "anthropic"

    def __init__(self, base_url: str, key: str, max_tokens: int) -> None:
        import anthropic

        self.client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=1800)
        self.max_tokens = max_tokens

    def send(self, req: Request, model: str) -> Reply:
        t0 = time.perf_counter()
        first = None
        content, reasoning = [], []
        usage: dict[str, Any] = {}
        # greedy through extra_body: the client no longer takes temperature itself
        stream = self.client.messages.create(
            model=model, max_tokens=self.max_tokens, system=[{"type": "text", "text": b} for b in req.system],
            messages=anthropic_messages(req.messages), stream=True, extra_body={"temperature": 0},
            **({"tools": anthropic_tools(req.tools)} if req.tools else {}))
        for ev in stream:
            if ev.type == "content_block_delta":
                text = getattr(ev.delta, "text", None) or ""
                think = getattr(ev.delta, "thinking", None) or ""
                if (text or think) and first is None:
                    first = time.perf_counter()
                content.append(text)
                reasoning.append(think)
            elif ev.type == "message_start":
                usage["message_start"] = ev.message.usage.model_dump()
            elif ev.type == "message_delta":
                usage["message_delta"] = ev.usage.model_dump()
        end = time.perf_counter()
        prompt, cached, output = anthropic_usage(usage)
        return Reply((first or end) - t0, end - t0, "".join(content), "".join(reasoning), prompt, cached, output,
                     usage)


def anthropic_usage(events: dict[str, dict]) -> tuple[int | None, int | None, int | None]:
    """(prompt, cached, output) tokens from a Messages stream's usage, by event
    type (pure). LiteLLM fills the final message_delta (message_start has
    zeros): input_tokens are the tokens not read from cache,
    cache_read_input_tokens the engine's cached_tokens, written only when
    positive (litellm/llms/anthropic/pass_through/adapters/transformation.py),
    so absent is 0."""
    final = events.get("message_delta") or events.get("message_start") or {}
    uncached = final.get("input_tokens")
    if uncached is None:
        return None, None, final.get("output_tokens")
    cached = final.get("cache_read_input_tokens") or 0
    return uncached + cached + (final.get("cache_creation_input_tokens") or 0), cached, final.get("output_tokens")


class Renderer:
    """The model's tokenizer and chat template: a turn's prompt tokens as the engine renders them."""

    def __init__(self, model: Path) -> None:
        from mlx_lm.utils import load_tokenizer

        self.tok = load_tokenizer(Path(model))
        self.think = (getattr(self.tok, "think_start", None) or "<think>",
                      getattr(self.tok, "think_end", None) or "</think>")

    def has_thinking(self) -> bool:
        template = getattr(self.tok, "chat_template", None) or ""
        return bool(getattr(self.tok, "has_thinking", False)) and self.think[0] in template

    def prompt(self, req: Request, strip_metadata: bool, sep: str = "\n") -> tuple[str, list[int]]:
        text = self.tok.apply_chat_template(req.openai_messages(strip_metadata, sep), tools=req.tools or None,
                                            add_generation_prompt=True, tokenize=False, **req.template_kwargs)
        return text, self.encode(text)

    def encode(self, text: str) -> list[int]:
        # the template writes the BOS itself; added tokens in the text are matched as the engine does
        return list(self.tok.encode(text, add_special_tokens=False))


# --- one arm --------------------------------------------------------------------------------

@dataclass
class Target:
    """Where an arm sends: the gateway (mlxd arms) or mlx_lm.server."""

    arm: str
    routes: dict[str, Any]
    model_name: Callable[[str], str]  # kind -> the request's model
    engine_url: str | None  # mlxd's engine, for /health
    strips_metadata: bool


def engine_health(url: str | None) -> dict[str, Any]:
    if url is None:
        return {}
    try:
        return requests.get(url + "/health", timeout=10).json().get("prompt_cache") or {}
    except (requests.RequestException, ValueError):
        return {}


def run_kind(target: Target, route: str, kind: str, script: Script, renderer: Renderer, rnd: int,
             turns_limit: int | None, bounds: dict[tuple[str, bool], Bounds]) -> tuple[list[dict], dict | None]:
    """One kind's conversation(s) on one route; rows per turn and the memory tier after it.
    `bounds`: the earlier requests to this server by (model, header stripped), every kind's."""
    client = target.routes[route]
    model = target.model_name(kind)
    before = engine_health(target.engine_url).get("memory_entries")
    rows = []
    for conversation, turn in script.order():
        if turns_limit and turn > turns_limit:
            break
        req = script.request(conversation, turn)
        row = {"arm": target.arm, "route": route, "kind": kind, "conversation": conversation, "turn": turn,
               "round": rnd}
        try:
            reply = client.send(req, model)
        except Exception as exc:  # noqa: BLE001 - report it, go on with the next kind
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
            say(f"   {target.arm} {route}/{kind} {conversation} turn {turn}: FAILED {row['error']}")
            break
        script.answer(req, reply.content)
        # The bound, outside the timed part: this prompt against every earlier prompt + answer.
        for strip in (True, False) if kind == "claude_code" else (target.strips_metadata,):
            text, tokens = renderer.prompt(req, strip, "" if route == "anthropic" else "\n")
            answer = renderer.encode(generated_text(reply.content, reply.reasoning,
                                                    text.rstrip().endswith(renderer.think[0]), renderer.think))
            earlier = bounds.setdefault((model, strip), Bounds())
            b = earlier.bound(tokens)
            earlier.add(tokens, answer)
            if strip == target.strips_metadata:
                row.update(bound_tokens=b, bound_prompt_tokens=len(tokens))
            else:
                row.update(bound_tokens_other=b, bound_other_assumes_stripped=strip)
        row.update(ttft_s=reply.ttft_s, total_s=reply.total_s, prompt_tokens=reply.prompt_tokens,
                   cached_tokens=reply.cached_tokens, completion_tokens=reply.completion_tokens,
                   content=reply.content[:2000], reasoning=reply.reasoning[:2000], usage=reply.usage)
        if target.engine_url:
            recent = engine_health(target.engine_url).get("recent") or []
            if recent:
                row["engine_reuse"] = recent[-1]  # the engine's own account of this turn's reuse
        rows.append(row)
        cached = "—" if reply.cached_tokens is None else str(reply.cached_tokens)
        say(f"   {target.arm:7s} {route:9s} {kind:19s} {conversation:12s} turn {turn}: TTFT "
            f"{reply.ttft_s * 1000:7.0f} ms  cached {cached:>5s} of {reply.prompt_tokens}  "
            f"bound {row['bound_tokens']} of {row['bound_prompt_tokens']}")
    after = engine_health(target.engine_url).get("memory_entries")
    memory = None if after is None else {"arm": target.arm, "route": route, "kind": kind, "round": rnd,
                                         "entries": after, "delta": after - (before or 0)}
    return rows, memory


def warm_up(target: Target, route: str, kind: str) -> None:
    """One short request first: the first request of a route (LiteLLM's
    Anthropic path) or a model (a swap, a GPU's kernel compilation) costs
    what a turn does not. Nothing in it is shared with the conversations."""
    req = Request("warmup", "warmup", 0, ["Warm up."], [{"role": "user", "content": "warm up " * 20}],
                  {"enable_thinking": True} if kind == "reasoning" else {}, tools=[])
    client = target.routes[route]
    saved = client.max_tokens
    client.max_tokens = 2
    try:
        client.send(req, target.model_name(kind))
    finally:
        client.max_tokens = saved


def arm_plan(arm: str, kinds: list[str], anthropic_kinds: list[str], nocache_kinds: list[str]) -> list[tuple[str, str]]:
    """(route, kind) pairs an arm runs, in order (pure): every kind on the
    OpenAI route, then the Anthropic ones (not for mlx_lm.server: it has no
    /v1/messages); nocache only its kinds; reasoning (another model) last."""
    if arm == "nocache":
        kinds = [k for k in kinds if k in nocache_kinds]
    plan = [("openai", k) for k in kinds if k != "reasoning"]
    if arm != "mlx_lm":
        plan += [("anthropic", k) for k in kinds if k in anthropic_kinds and k != "reasoning"]
    if "reasoning" in kinds:
        plan.append(("openai", "reasoning"))
    return plan


def start_mlx_lm(model: Path, workdir: Path, tag: str) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model.resolve()), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "WARNING"]
    return spawn(f"mlx_lm.server ({tag})", argv, child_env(), workdir / f"mlx_lm-{tag}-{time.monotonic_ns()}.log",
                 port, "/v1/models")


def approx_refusal(stack: Any) -> str | None:
    """Why the config refuses `approximate` (None: it takes it). The stack's
    config is parsed as its processes parse it."""
    try:
        stack.config  # noqa: B018 - parsing is the check
    except Exception as exc:  # noqa: BLE001 - any refusal is reported as it is
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def run_arm(arm: str, rnd: int, args: argparse.Namespace, models: dict[str, Path], systems: dict[str, str],
            renderers: dict[str, Renderer], plan: list[tuple[str, str]], workdir: Path,
            notes: list[str]) -> tuple[list[dict], list[dict]]:
    from mlxd.devkit.stack import Stack

    rows: list[dict] = []
    memory: list[dict] = []
    mlx_servers: dict[str, Server] = {}
    stack = None
    try:
        if arm == "mlx_lm":
            def model_name(kind: str) -> str:
                return str(models["reasoning" if kind == "reasoning" else "main"].resolve())

            server = mlx_servers["main"] = start_mlx_lm(models["main"], workdir, "main")
            server.wait_ready(args.startup_timeout)
            target = Target(arm, {"openai": OpenAIRoute(server.url + "/v1", "none", args.max_tokens)},
                            model_name, None, strips_metadata=False)
        else:
            engine = {**ENGINE, **({"strip_metadata": []} if args.keep_metadata else {}),
                      "prompt_cache": ARM_CACHE[arm]}
            extra = (dumps({"models": {"think": {"path": models["reasoning"].resolve()}}})
                     if "reasoning" in models else "")
            stack = Stack.create(workdir / f"home-{arm}-{rnd}", models["main"].resolve(), model_name="bench",
                                 engine=engine, gateway="", models=extra, faults=False)
            if arm == "approx" and (why := approx_refusal(stack)):
                notes.append(f"approx arm skipped: the engine's config refuses `[engine.prompt_cache] approximate "
                             f"= true` ({why}); it runs as soon as the engine takes the key")
                say(f"   {notes[-1]}")
                stack = None
                return rows, memory
            t0 = time.monotonic()
            stack.up(args.startup_timeout)
            say(f"   stack up in {time.monotonic() - t0:.1f} s (gateway {stack.gateway_url}, engine {stack.bare_url})")
            target = Target(arm, {"openai": OpenAIRoute(stack.gateway_url + "/v1", stack.key, args.max_tokens),
                                  "anthropic": AnthropicRoute(stack.gateway_url, stack.key, args.max_tokens)},
                            lambda kind: "think" if kind == "reasoning" else "default", stack.url,
                            strips_metadata=not args.keep_metadata)
        warmed: set[tuple[str, str]] = set()
        bounds: dict[tuple[str, bool], Bounds] = {}  # every request this server saw, for the bound
        for route, kind in plan:
            if kind == "reasoning" and arm == "mlx_lm" and "reasoning" not in mlx_servers:
                stop_child(mlx_servers.pop("main").proc)  # one model at a time, as the engine does
                server = mlx_servers["reasoning"] = start_mlx_lm(models["reasoning"], workdir, "reasoning")
                server.wait_ready(args.startup_timeout)
                target.routes["openai"] = OpenAIRoute(server.url + "/v1", "none", args.max_tokens)
            model_key = (route, "reasoning" if kind == "reasoning" else "main")
            if model_key not in warmed:
                warmed.add(model_key)
                try:
                    warm_up(target, route, kind)
                except Exception as exc:  # noqa: BLE001 - the kind's first turn will say more
                    notes.append(f"{arm}: the warm-up request on the {route} route failed: {exc}"[:300])
                    say(f"   {notes[-1]}")
            renderer = renderers["reasoning" if kind == "reasoning" else "main"]
            script = Script(kind, systems[f"{route}/{kind}"], args.turns, seed=args.seed * 1000 + rnd)
            limit = args.nocache_turns if arm == "nocache" else None
            r, m = run_kind(target, route, kind, script, renderer, rnd, limit, bounds)
            rows += r
            if m is not None:
                memory.append(m)
                say(f"   {arm} {route}/{kind}: memory tier holds {m['entries']} entries "
                    f"({m['delta']:+d} over the kind)")
    finally:
        if stack is not None:
            stack.stop()
        for server in mlx_servers.values():
            stop_child(server.proc)
    return rows, memory


# --- main ----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an mlx-lm model folder (default: demo model a; reasoning: demo think)")
    ap.add_argument("--system-tokens", type=int, default=None,
                    help="the system turn's size in tokens with the declared tools' schemas, about (1500; --quick "
                         "500; 3700 is Claude Code's, for a GPU); at least the tools' + 100")
    ap.add_argument("--turns", type=int, default=None, help="turns per conversation (8)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    ap.add_argument("--rounds", type=int, default=1, help="rounds; arms alternate, the first arm rotating")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--anthropic-kinds", default=None,
                    help="kinds also run on the Anthropic route (clean,claude_code; '' for none)")
    ap.add_argument("--nocache-kinds", default="claude_code", help="kinds the nocache arm runs ('all' for every one)")
    ap.add_argument("--nocache-turns", type=int, default=4,
                    help="turns the nocache arm runs of each kind (4: turns 1-4; 0: all); each is a whole prefill")
    ap.add_argument("--keep-metadata", action="store_true",
                    help="run mlxd with `[engine] strip_metadata = []` and compute its bound with the Claude Code "
                         "header kept (default: the engine strips it, and so does the bound)")
    ap.add_argument("--quick", action="store_true",
                    help="3 turns, the smallest system prompt, 8-token answers, claude_code alone on the Anthropic "
                         "route: about 2-3 minutes on 2 CPU cores")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--out-dir", type=Path, default=RESULTS / "agent_replay")
    args = ap.parse_args(argv)
    quick = args.quick
    args.system_tokens = args.system_tokens or (500 if quick else 1500)
    args.turns = args.turns or (3 if quick else 8)
    if args.anthropic_kinds is None:
        args.anthropic_kinds = "claude_code" if quick else "clean,claude_code"
    if quick and args.max_tokens == 16:
        args.max_tokens = 8
    return args


def tools_tokens(renderer: Renderer) -> int:
    """What declaring TOOLS adds to a prompt, in tokens."""
    def size(tools: list[dict]) -> int:
        req = Request("size", "size", 1, ["x"], [{"role": "user", "content": "x"}], tools=tools)
        return len(renderer.prompt(req, True)[1])

    return size(TOOLS) - size([])


def split_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [x for x in text.split(",") if x]
    unknown = [x for x in items if x not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (one of {', '.join(allowed)})")
    return items


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    interrupt_on_sigterm()
    arms = split_list(args.arms, ARMS, "arm")
    kinds = split_list(args.kinds, KINDS, "kind")
    anthropic_kinds = split_list(args.anthropic_kinds, KINDS, "kind")
    nocache_kinds = list(KINDS) if args.nocache_kinds == "all" else split_list(args.nocache_kinds, KINDS, "kind")
    notes: list[str] = []
    t_start = time.monotonic()

    models = {"main": args.model or demo_model("a")[1]}
    renderers = {"main": Renderer(models["main"])}
    if "reasoning" in kinds:
        if args.model is None:
            models["reasoning"] = demo_model("think")[1]
            renderers["reasoning"] = Renderer(models["reasoning"])
        elif renderers["main"].has_thinking():
            models["reasoning"], renderers["reasoning"] = models["main"], renderers["main"]
        else:
            kinds.remove("reasoning")
            notes.append(f"reasoning skipped: {args.model}'s chat template has no think markers")
    count = lambda s: len(renderers["main"].encode(s))  # noqa: E731
    # --system-tokens counts the declared tools' schemas too (the template writes them into the system turn).
    text_tokens = max(100, args.system_tokens - tools_tokens(renderers["main"]))
    # One system prompt per (route, kind): kinds and routes never share a cached prefix.
    systems = {f"{route}/{kind}": system_prompt(text_tokens, f"{route}/{kind}", count)
               for route in ROUTES for kind in KINDS}
    plans = {arm: arm_plan(arm, kinds, anthropic_kinds, nocache_kinds) for arm in arms}
    say(f"agent replay: arms {', '.join(arms)}; system prompt ~{args.system_tokens} tokens, {args.turns} turns, "
        f"{args.max_tokens} tokens an answer, {args.rounds} round(s)")
    for arm in arms:
        say(f"   {arm}: " + ", ".join(f"{r}/{k}" for r, k in plans[arm]))

    rows: list[dict] = []
    memory: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mlxd-replay-") as tmp:
        try:
            for rnd in range(args.rounds):
                for arm in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:
                    if any(n.startswith(f"{arm} arm skipped") for n in notes):
                        continue
                    say(f"round {rnd + 1}/{args.rounds}: {arm} ({time.monotonic() - t_start:.0f} s so far)")
                    try:
                        r, m = run_arm(arm, rnd, args, models, systems, renderers, plans[arm], Path(tmp), notes)
                    except Exception as exc:  # noqa: BLE001 - a server that never came up: the other arms still run
                        notes.append(f"{arm} arm failed in round {rnd + 1}: {type(exc).__name__}: {exc}"[:1500])
                        say(f"   {notes[-1]}")
                        continue
                    rows += r
                    memory += m
        finally:
            stop_all_children()

    summary = summarize(rows)
    ratios = [x for route in ROUTES if (x := ttft_ratio(rows, "claude_code", route)) is not None]
    errors = [r for r in rows if r.get("error")]
    mismatched = [r for r in rows if not r.get("error") and r["arm"] != "mlx_lm" and r.get("prompt_tokens") is not None
                  and r["prompt_tokens"] != r["bound_prompt_tokens"]]
    if mismatched:
        notes.append(f"{len(mismatched)} of {len(rows)} mlxd turns: the engine counted other prompt tokens than the "
                     "bound's rendering (" + ", ".join(sorted({f"{r['route']}/{r['kind']}" for r in mismatched}))
                     + "); their bound is of a slightly different prompt")
    for e in errors:
        notes.append(f"{e['arm']} {e['route']}/{e['kind']} {e['conversation']} turn {e['turn']} failed: {e['error']}")
    if "mlx_lm" in arms and not any(r["arm"] == "mlx_lm" and r.get("cached_tokens") is not None for r in rows):
        notes.append("mlx_lm.server reported no cached tokens: only its TTFT is comparable")
    runtime = time.monotonic() - t_start

    first = [r["bound_prompt_tokens"] for r in rows if r["turn"] == 1 and r["kind"] == "clean" and not r.get("error")]
    size = f" (turn 1 of clean: {statistics.median(first):.0f} tokens)" if first else ""
    title = (f"Agent replay: {models['main'].name}, system prompt ~{args.system_tokens} tokens{size}, "
             f"{args.turns} turns, {args.max_tokens} tokens an answer, {args.rounds} round(s); metadata "
             f"{'kept' if args.keep_metadata else 'stripped by the engine'}")
    md = [f"## {title}", "", markdown_table(summary, memory_by_group(memory)), ""]
    md.append("cached / bound: share of the prompt's tokens (turns 3–N: median (min–max)); memory entries: the "
              "engine's memory tier after the kind (change over it), medians over rounds.")
    for x in ratios:
        met = "met" if x["ratio"] <= 0.1 else "NOT met"
        md.append(f"claude_code TTFT, cache over nocache, {x['route']} route: **{x['ratio']:.3f}×** "
                  f"({x['arm_ttft_ms']:.0f} vs {x['anchor_ttft_ms']:.0f} ms, turns {x['turns']}; "
                  f"goal ≤ 0.1×: {met})")
    agreement = [x for arm in ("cache", "approx") if (x := answers_agree(rows, arm, "nocache")) is not None]
    for x in agreement:
        md.append(f"greedy answers, {x['arm']} vs {x['anchor']} on the same turns: {x['identical']} of "
                  f"{x['compared']} identical")
    md += [f"note: {n}" for n in notes]
    md.append(f"runtime: {runtime:.0f} s")
    text = "\n".join(md)
    print(text)

    out_md, out_json = args.out_dir / "agent_replay.md", args.out_dir / "agent_replay.json"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out_md.write_text(text + "\n")
    write_json(out_json, {"machine": machine_info(), "models": {k: str(v) for k, v in models.items()},
                          "settings": vars(args) | {"arms": arms, "kinds": kinds, "anthropic_kinds": anthropic_kinds,
                                                    "nocache_kinds": nocache_kinds},
                          "plans": plans, "summary": summary, "claude_code_ttft_ratio": ratios, "memory": memory,
                          "answers_agree": agreement,
                          "notes": notes, "runtime_s": runtime, "rows": rows})
    print(f"results: {out_md}, {out_json}")
    return 1 if errors or not rows or any(" arm failed" in n for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
