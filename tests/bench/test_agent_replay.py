"""bench/agent_replay.py's pure parts, as tables: what each kind of scripted
conversation sends turn by turn, the exact-prefix bound, which (route, kind)
pairs each arm runs, and how rows become the table. No server is started."""

from __future__ import annotations

import re

import pytest

from testkit import load_bench

ar = load_bench("agent_replay")
BASE = "\n".join(f"line {i} of the system prompt" for i in range(10))


def replay(kind: str, turns: int = 4, answer=lambda conv, t: f"answer {conv} {t}") -> list:
    """Every request of a kind's script, answered with `answer`."""
    script = ar.Script(kind, BASE, turns)
    sent = []
    for conv, t in script.order():
        req = script.request(conv, t)
        sent.append(req)
        script.answer(req, answer(conv, t))
    return sent


# --- the conversations -----------------------------------------------------------------------

@pytest.mark.parametrize("kind, requests", [("clean", 4), ("claude_code", 4), ("clock", 4), ("system_reminder", 4),
                                            ("subagents", 12), ("edited_tool_results", 4), ("reasoning", 4)])
def test_every_kind_sends_its_turns_and_carries_answers_back(kind, requests):
    sent = replay(kind)
    assert len(sent) == requests
    for req in sent[-3:]:  # every answer of the conversation so far went back as an assistant message
        answers = [m["content"] for m in req.messages if m["role"] == "assistant"]
        assert answers == [f"answer {req.conversation} {t}" for t in range(1, req.turn)]
        assert req.openai_messages()[0]["role"] == "system"


def test_claude_code_header_is_the_first_block_with_a_new_hash_every_request():
    sent = replay("claude_code")
    hashes = []
    for req in sent:
        header, body = req.system
        m = re.fullmatch(r"x-anthropic-billing-header: cc_version=2\.1\.120\.cf9; cc_entrypoint=cli; "
                         r"cch=([0-9a-f]{5});", header)
        assert m and body == BASE
        hashes.append(m.group(1))
        assert ar.system_text(req.system, strip_metadata=True) == BASE
        assert ar.system_text(req.system, strip_metadata=False) == header + "\n" + BASE  # one string, OpenAI route
        assert ar.system_text(req.system, strip_metadata=False, sep="") == header + BASE  # Anthropic blocks, joined
    assert len(set(hashes)) == len(hashes)


def test_clock_sits_mid_prompt_same_width_advancing():
    sent = replay("clock")
    texts = [req.system[0] for req in sent]
    clocks = [re.search(r"Current time is (\S+ \S+)", t).group(1) for t in texts]
    assert clocks[0] == "2026-11-25 10:42:13" and clocks == sorted(set(clocks))
    assert len({len(t) for t in texts}) == 1  # same width: only the digits change
    before = {t[:t.index("Current time")] for t in texts}
    assert len(before) == 1 and 0.3 < len(before.pop()) / len(texts[0]) < 0.7


def test_system_reminder_changes_each_turn_and_earlier_messages_go_back_as_sent():
    sent = replay("system_reminder")
    users = [[m["content"] for m in req.messages if m["role"] == "user"] for req in sent]
    for t, us in enumerate(users, start=1):
        assert len(us) == t and us[:-1] == users[t - 2] if t > 1 else True
        assert us[-1].startswith("<system-reminder>\n") and "</system-reminder>\n" in us[-1]
    reminders = [us[-1].split("</system-reminder>")[0] for us in users]
    assert len(set(reminders)) == len(reminders)


def test_subagents_interleave_turn_by_turn_and_share_the_prompt_up_to_their_task():
    sent = replay("subagents", turns=2)
    assert [(r.conversation, r.turn) for r in sent] == [
        ("orchestrator", 1), ("subagent-1", 1), ("subagent-2", 1),
        ("orchestrator", 2), ("subagent-1", 2), ("subagent-2", 2)]
    systems = {r.conversation: r.system[0] for r in sent}
    assert len(set(systems.values())) == 3
    assert all(s.startswith(BASE + "\n# Your task\n") for s in systems.values())


@pytest.mark.parametrize("turns, clear_turn", [(3, 3), (4, 3), (8, 5), (10, 6)])
def test_edited_tool_results_clear_the_first_result_from_the_middle_turn_on(turns, clear_turn):
    sent = replay("edited_tool_results", turns=turns)
    for req in sent:
        tools = [m for m in req.messages if m["role"] == "tool"]
        assert len(tools) == req.turn - 1
        assert [m["role"] for m in req.messages][-1] == ("user" if req.turn == 1 else "tool")
        if tools:
            assert (tools[0]["content"] == ar.CLEARED) == (req.turn >= clear_turn)
            assert all(m["content"] != ar.CLEARED for m in tools[1:])
        calls = [m["tool_calls"][0] for m in req.messages if m["role"] == "assistant"]
        assert [c["id"] for c in calls] == [m["tool_call_id"] for m in tools]


def test_reasoning_turns_switch_thinking_on_and_send_no_reasoning_back():
    sent = replay("reasoning", answer=lambda conv, t: "")
    assert all(req.template_kwargs == {"enable_thinking": True} for req in sent)
    assert [m["content"] for m in sent[-1].messages if m["role"] == "assistant"] == ["(no output)"] * 3


def test_the_anthropic_route_takes_plain_turns_only():
    assert ar.anthropic_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError):
        ar.anthropic_messages([{"role": "tool", "tool_call_id": "x", "content": "r"}])
    (tool,) = ar.anthropic_tools(ar.TOOLS[:1])
    assert tool["name"] == "read_file" and tool["input_schema"]["required"] == ["path"]


ZEROS = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("events, expected", [
    # what LiteLLM sends: zeros first, the figures in message_delta, input_tokens the uncached ones
    ({"message_start": ZEROS, "message_delta": {"input_tokens": 26, "cache_read_input_tokens": 706,
                                                "cache_creation_input_tokens": None, "output_tokens": 8}},
     (732, 706, 8)),
    # nothing cached: LiteLLM leaves cache_read_input_tokens out (null)
    ({"message_start": ZEROS, "message_delta": {"input_tokens": 700, "cache_read_input_tokens": None,
                                                "output_tokens": 8}}, (700, 0, 8)),
    ({"message_start": ZEROS | {"input_tokens": None}}, (None, None, 0)),  # no usage at all
])
def test_anthropic_usage(events, expected):
    assert ar.anthropic_usage(events) == expected


def test_system_prompt_reaches_its_size_and_starts_with_its_salt():
    count = lambda s: len(s) // 3  # noqa: E731
    text = ar.system_prompt(800, "openai/clock", count)
    assert text.startswith("[openai/clock] ") and 800 <= count(text) < 800 + 200
    assert ar.system_prompt(800, "openai/clean", count).split("]")[0] != text.split("]")[0]


def test_clock_line_keeps_its_width_across_days():
    assert len({len(ar.clock_line(t)) for t in (1, 2, 100, 2000)}) == 1


# --- the bound ------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, earlier, bound", [
    ([1, 2, 3, 4], [], 0),
    ([1, 2, 3, 4], [[1, 2, 9]], 2),
    ([1, 2, 3, 4], [[1, 2, 9], [1, 2, 3, 7]], 3),  # the best earlier request
    ([1, 2, 3, 4], [[1, 2, 3, 4, 5, 6]], 3),  # the last prompt token is always prefilled
    ([1, 2, 3, 4], [[1, 2, 3, 4]], 3),
    ([5], [[5, 6]], 0),
    ([9, 2, 3], [[1, 2, 3]], 0),  # a changed first token (Claude Code's header kept) ends it at once
])
def test_exact_prefix_bound(prompt, earlier, bound):
    assert ar.exact_prefix_bound(prompt, earlier) == bound


def test_bounds_count_each_earlier_prompt_with_its_answer():
    b = ar.Bounds()
    assert b.bound([1, 2, 3]) == 0
    b.add([1, 2, 3], [7, 8])  # prompt, then the answer's tokens
    assert b.bound([1, 2, 3, 7, 8, 4, 5]) == 5  # the answer came back as generated
    assert b.bound([1, 2, 3, 6, 4, 5]) == 3  # the answer came back otherwise (a dropped <think>)


@pytest.mark.parametrize("content, reasoning, opened, text", [
    ("Paris.", "", False, "Paris."),
    ("Paris.", "think hard", True, "think hard</think>Paris."),  # the template opened the block
    ("Paris.", "think hard", False, "<think>think hard</think>Paris."),
    ("", "cut off mid-thought", True, "cut off mid-thought"),  # max_tokens inside the reasoning
])
def test_generated_text_puts_reasoning_inside_its_markers(content, reasoning, opened, text):
    assert ar.generated_text(content, reasoning, opened) == text


# --- plans and summaries ----------------------------------------------------------------------

@pytest.mark.parametrize("arm, plan", [
    ("cache", [("openai", "clean"), ("openai", "claude_code"), ("openai", "clock"), ("anthropic", "clean"),
               ("anthropic", "claude_code"), ("openai", "reasoning")]),
    ("mlx_lm", [("openai", "clean"), ("openai", "claude_code"), ("openai", "clock"), ("openai", "reasoning")]),
    ("nocache", [("openai", "claude_code"), ("anthropic", "claude_code")]),
])
def test_arm_plan(arm, plan):
    kinds = ["clean", "reasoning", "claude_code", "clock"]
    assert ar.arm_plan(arm, [k for k in ar.KINDS if k in kinds], ["clean", "claude_code"], ["claude_code"]) == plan


def _row(arm, turn, ttft, cached, prompt=100, bound=90, kind="claude_code", route="openai", conv="main", **kw):
    return {"arm": arm, "kind": kind, "route": route, "conversation": conv, "turn": turn, "round": 0,
            "ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached, "bound_tokens": bound,
            "bound_prompt_tokens": prompt, **kw}


def test_summarize_gives_turn_2_and_the_spread_of_turns_3_to_n():
    rows = [_row("cache", 1, 5.0, 0, bound=0), _row("cache", 2, 0.4, 80), _row("cache", 3, 0.3, 90),
            _row("cache", 4, 0.5, 95, bound=96), _row("cache", 5, 0.2, None, error="boom"),
            _row("mlx_lm", 1, 6.0, None, bound=0), _row("mlx_lm", 2, 6.1, None, bound=5)]
    cache, mlx = ar.summarize(rows)
    assert (cache["arm"], cache["turns"], cache["requests"]) == ("cache", 4, 4)  # the failed turn left out
    assert cache["turn1_ttft_ms"] == 5000 and cache["turn2_ttft_ms"] == 400
    assert (cache["turn2_cached"], cache["turn2_bound"]) == (0.8, 0.9)
    assert cache["later_cached"] == pytest.approx({"median": 0.925, "min": 0.9, "max": 0.95})
    assert cache["later_bound"] == pytest.approx({"median": 0.93, "min": 0.9, "max": 0.96})
    assert cache["later_ttft_ms"] == 400
    assert mlx["turn2_cached"] is None and mlx["turn2_bound"] == 0.05 and mlx["later_cached"] is None


def test_ttft_ratio_pairs_the_same_turns_and_takes_the_median():
    rows = [_row("cache", t, 0.5, 90) for t in (1, 2, 3, 4)] + [_row("nocache", t, 5.0 + t, 0) for t in (1, 2, 3)]
    rows.append(_row("cache", 2, 0.5, 90, route="anthropic"))
    r = ar.ttft_ratio(rows, "claude_code", "openai")
    assert r["turns"] == [2, 3] and r["ratio"] == pytest.approx((0.5 / 7 + 0.5 / 8) / 2)
    assert ar.ttft_ratio(rows, "claude_code", "anthropic") is None  # no nocache turns to pair with


def test_markdown_table_rows_and_memory_column():
    rows = [_row("cache", 1, 5.0, 0, bound=0), _row("cache", 2, 0.4, 80), _row("cache", 3, 0.3, 90)]
    memory = ar.memory_by_group([{"arm": "cache", "route": "openai", "kind": "claude_code", "round": 0,
                                  "entries": 3, "delta": 1}])
    table = ar.markdown_table(ar.summarize(rows), memory).splitlines()
    assert len(table) == 3
    assert table[2] == ("| claude_code | openai | cache | 5000 | 80.0 % | 90.0 % | 400 | 90.0 % (90.0–90.0) "
                        "| 90.0 % (90.0–90.0) | 300 | 3 (+1) |")


def test_answers_agree_compares_the_same_turns_only():
    rows = [_row("cache", t, 0.5, 90) | {"content": f"a{t}"} for t in (1, 2, 3)]
    rows += [_row("nocache", t, 5.0, 0) | {"content": "a1" if t == 1 else "other"} for t in (1, 2)]
    got = ar.answers_agree(rows, "cache", "nocache")
    assert (got["compared"], got["identical"]) == (2, 1)
    assert got["differ"] == [["claude_code", "openai", "main", 2, 0]]
    assert ar.answers_agree(rows, "cache", "mlx_lm") is None
