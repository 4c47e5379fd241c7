"""Agents' real prompts in a real engine process: Claude Code's per-request
header is not prompt, a clock inside the system prompt ends exact reuse where
it stands (and approximate reuse, opted into, goes past it), each live
conversation keeps one entry, and /health, /metrics and the log say where
and why reuse stopped. Token counts come from the demo model's tokenizer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests

from mlxd.toml_text import dumps
from testkit import common_prefix, prompt_ids, settled_health, wait_until

pytestmark = pytest.mark.timeout(240)

HEAD = "You are a careful coding agent for the mlxd project. " * 12
TAIL = "Use the tools to read files before you change them. " * 12
HEADER = "x-anthropic-billing-header: cc_version=2.1.120.cf9; cc_entrypoint=cli; cch={:05x};"


def toml(model: Path, cache: dict | None = None, engine: dict | None = None, name: str = "demo-a") -> str:
    """One model, the default; the prompt cache in memory only unless `cache`
    (its settings) says otherwise; `engine`: more [engine] settings."""
    return dumps({"engine": {"max_tokens_cap": 64, **(engine or {}), "prompt_cache": {"disk": False, **(cache or {})}},
                  "models": {name: {"path": model}}, "aliases": {"default": name}})


def ask(url: str, messages: list[dict], max_tokens: int = 6) -> tuple[str, dict]:
    body = {"model": "demo-a", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    b = r.json()
    return b["choices"][0]["message"]["content"], b["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def health(url: str) -> dict:
    return settled_health(url)["prompt_cache"]


def clock_system(minute: int) -> str:
    return f"{HEAD}\nCurrent time is 2026-11-25 10:{minute:02d}:13\n{TAIL}"


def replay(url: str, system_for_turn, turns: int = 4) -> list[tuple[list[dict], dict]]:
    """A conversation whose system prompt may change each turn: (messages, usage) per turn."""
    history: list[dict] = []
    out = []
    for turn in range(1, turns + 1):
        history.append({"role": "user", "content": f"question {turn}: what does step {turn} do?"})
        messages = [{"role": "system", "content": system_for_turn(turn)}] + history
        reply, usage = ask(url, messages)
        history.append({"role": "assistant", "content": reply})
        out.append((messages, usage))
    return out


def test_claude_codes_billing_header_is_not_prompt(start_engine, demo_models, tokenizer):
    ep = start_engine(toml=toml(demo_models.a))
    turns = replay(ep.url, lambda turn: HEADER.format(0x1000 * turn + 7) + "\n" + HEAD + TAIL)
    for i, (messages, usage) in enumerate(turns):
        # The model sees the prompt without the header: its token count says so.
        without = [{"role": "system", "content": HEAD + TAIL}] + messages[1:]
        assert usage["prompt_tokens"] == len(prompt_ids(tokenizer, without))
        if i:
            assert cached(usage) >= 0.9 * usage["prompt_tokens"], (i, usage)
    assert health(ep.url)["memory_entries"] == 1


def test_the_header_stays_when_the_rule_is_off(start_engine, demo_models, tokenizer):
    ep = start_engine(toml=toml(demo_models.a, engine={"strip_metadata": []}))
    turns = replay(ep.url, lambda turn: HEADER.format(0x1000 * turn + 7) + "\n" + HEAD + TAIL, turns=2)
    messages, usage = turns[1]
    assert usage["prompt_tokens"] == len(prompt_ids(tokenizer, messages))
    assert cached(usage) < 0.1 * usage["prompt_tokens"]  # the header differs within its first tokens


def test_a_clock_ends_exact_reuse_where_it_stands_and_one_entry_is_kept(start_engine, demo_models, tokenizer):
    ep = start_engine(toml=toml(demo_models.a))
    turns = replay(ep.url, lambda turn: clock_system(10 + turn), turns=5)
    for (before, _), (messages, usage) in zip(turns, turns[1:]):
        at_clock = common_prefix(prompt_ids(tokenizer, before), prompt_ids(tokenizer, messages))
        assert 50 < at_clock < usage["prompt_tokens"] / 2
        assert cached(usage) == at_clock  # exact: not a token past the change
    stats = health(ep.url)
    # Each turn continued the conversation's entry and replaced it: one entry, not one per turn.
    assert stats["memory_entries"] == 1 and stats["superseded"] >= 4
    # Where and why reuse stopped, for status and /metrics.
    last = stats["recent"][-1]
    assert last["stopped_at"] == at_clock and f"differs from the cached conversation at token {at_clock}" in last["why"]
    assert len({r["conversation"] for r in stats["recent"]}) == 1
    metrics = requests.get(ep.url + "/metrics", timeout=5).text
    assert re.search(rf'mlxd_engine_prompt_cache_stopped_at\{{conversation="{last["conversation"]}"\}} {at_clock}',
                     metrics), metrics[-2000:]


def same_length_minutes(tokenizer, n: int) -> list[int]:
    """Minutes whose clock line tokenizes to as many tokens as 10:10's: the
    clock changes in place, as a real tokenizer's digits do."""
    def length(minute: int) -> int:
        return len(tokenizer.encode(clock_system(minute), add_special_tokens=False))
    return [m for m in range(10, 60) if length(m) == length(10)][:n]


def test_approximate_reuse_goes_past_a_changed_clock(start_engine, demo_models, tokenizer):
    ep = start_engine(toml=toml(demo_models.a, {"approximate": True}))
    minutes = same_length_minutes(tokenizer, 4)
    assert len(minutes) == 4
    turns = replay(ep.url, lambda turn: clock_system(minutes[turn - 1]), turns=4)
    for messages, usage in turns[1:]:
        assert cached(usage) >= 0.9 * usage["prompt_tokens"], usage
    stats = health(ep.url)
    assert stats["recomputed_tokens"] > 0 and "approximate" in stats["recent"][-1]["why"]
    assert stats["memory_entries"] == 1
    # A changed span of another length shifts everything after it: exact reuse up to it, never a wrong depth.
    longer = [{"role": "system", "content": clock_system(59).replace("10:59:13", "10:59:13.250")}] + turns[-1][0][1:]
    _, usage = ask(ep.url, longer)
    assert cached(usage) == common_prefix(prompt_ids(tokenizer, turns[-1][0]), prompt_ids(tokenizer, longer))


def test_interleaved_conversations_keep_their_own_entries(start_engine, demo_models, tokenizer):
    """Two sub-agents whose prompts differ in a few tokens: neither replaces the other's entry."""
    ep = start_engine(toml=toml(demo_models.a))
    histories = {name: [{"role": "system", "content": HEAD + TAIL}] for name in ("task 1111", "task 2222")}
    for turn in range(1, 4):
        for name, history in histories.items():
            previous = prompt_ids(tokenizer, history[:-1]) if turn > 1 else []  # its last turn's prompt
            history.append({"role": "user", "content": f"{name}, turn {turn}"})
            reply, usage = ask(ep.url, history)
            if turn > 1:  # its own whole conversation so far (but the generation prompt), not only the shared start
                assert cached(usage) >= len(previous) - 3, (name, turn, usage)
            history.append({"role": "assistant", "content": reply})
    assert health(ep.url)["memory_entries"] == 2


def test_the_debug_log_shows_both_sides_where_reuse_stopped(start_engine, demo_models):
    ep = start_engine(toml=toml(demo_models.a, engine={"log_level": "debug"}))
    replay(ep.url, lambda turn: clock_system(10 + turn), turns=2)
    wait_until(lambda: "where it stopped the cache holds" in ep.log(), timeout=10,
               what="the debug line about where reuse stopped")
    line = next(x for x in ep.log().splitlines() if "where it stopped the cache holds" in x)
    assert "11" in line and "12" in line, line  # the clock's minutes, before and now


def test_a_reasoning_conversation_keeps_one_entry(start_engine, think_model):
    """The template drops earlier turns' think blocks, so each turn's prompt
    parts from the cached answer: the turn still continues, and replaces, its
    conversation's entry."""
    ep = start_engine(toml=toml(think_model, name="think"))
    messages = [{"role": "system", "content": HEAD}]
    for turn in range(1, 5):
        messages.append({"role": "user", "content": f"question {turn}"})
        r = requests.post(ep.url + "/v1/chat/completions", timeout=120, json={
            "model": "think", "messages": messages, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        if turn > 1:
            assert cached(usage) >= 0.8 * usage["prompt_tokens"], usage
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"})
    stats = health(ep.url)
    assert stats["memory_entries"] == 1 and stats["superseded"] == 3, stats


def test_on_disk_too_a_conversation_keeps_one_entry(start_engine, demo_models):
    ep = start_engine(toml=toml(demo_models.a, {"disk": True}))
    history: list[dict] = []
    for turn in range(1, 5):
        history.append({"role": "user", "content": f"question {turn}"})
        reply, _ = ask(ep.url, [{"role": "system", "content": clock_system(10 + turn)}] + history)
        history.append({"role": "assistant", "content": reply})
        # The turn's entry is written behind it (its prompt's blocks, then its answer's), and the write
        # deletes the turn before's entry.
        wait_until(lambda: (lambda h: h["disk_writes"] >= turn and h["disk_writes_pending"] == 0)(health(ep.url)),
                   timeout=30, what=f"turn {turn}'s writes")
        assert health(ep.url)["disk_entries"] == 1
