"""A conversation longer than the model's context (engine/model/context_overflow.py):
the pure rules as tables, then truncate_middle served over HTTP with real clients."""

from __future__ import annotations

import anthropic
import openai
import pytest
import requests

from mlxd.engine.model.context_overflow import (TRUNCATED_HEADER, Truncation, answer_room, fewest_turns_to_drop,
                                                turns, without_oldest)
from mlxd.toml_text import dumps

SYS = {"role": "system", "content": "sys"}


def u(n):
    return {"role": "user", "content": f"u{n}"}


def a(n):
    return {"role": "assistant", "content": f"a{n}"}


CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "r"}


@pytest.mark.parametrize("messages, want", [
    ([SYS, u(1), a(1), u(2)], [[1, 2], [3]]),
    # a tool call and its result belong to the turn that asked for them
    ([SYS, u(1), CALL, RESULT, a(1), u(2), a(2), u(3)], [[1, 2, 3, 4], [5, 6], [7]]),
    # system messages belong to no turn, wherever they are (kept)
    ([SYS, u(1), a(1), {"role": "developer", "content": "d"}, u(2)], [[1, 2], [4]]),
    # an assistant message before any user message opens the first turn
    ([SYS, a(0), u(1), a(1)], [[1], [2, 3]]),
    ([SYS], []),
    ([u(1)], [[0]]),
])
def test_turns(messages, want):
    assert turns(messages) == want


def test_without_oldest_keeps_system_messages_and_whole_newer_turns():
    messages = [SYS, u(1), CALL, RESULT, a(1), {"role": "developer", "content": "d"}, u(2), a(2), u(3)]
    groups = turns(messages)
    assert without_oldest(messages, groups, 0) == messages
    assert without_oldest(messages, groups, 1) == [SYS, messages[5], u(2), a(2), u(3)]
    assert without_oldest(messages, groups, 2) == [SYS, messages[5], u(3)]


@pytest.mark.parametrize("context, max_tokens, want", [
    (8192, 1024, 1024), (8192, 100_000, 2048), (8192, 0, 1), (100, 10, 10), (100, 60, 25)])
def test_answer_room(context, max_tokens, want):
    assert answer_room(context, max_tokens) == want


@pytest.mark.parametrize("sizes, limit, want", [
    # the prompt's tokens without the oldest k turns, k = 0, 1, ...
    ([100, 80, 60, 40, 20], 60, 2),
    ([100, 80, 60, 40, 20], 79, 2),
    ([100, 80, 60, 40, 20], 80, 1),
    ([100, 80, 60, 40, 20], 20, 4),
    ([100, 80, 60, 40, 20], 19, None),  # even the newest turn alone is over: nothing to do but refuse
    ([100], 50, None),  # one turn: never dropped
    ([100, 100, 100, 30], 50, 3),  # a turn with no tokens of its own (a sibling's template) still counts
])
def test_fewest_turns_to_drop(sizes, limit, want):
    asked: list[int] = []

    def count(k):
        asked.append(k)
        return sizes[k]

    assert fewest_turns_to_drop(count, len(sizes), limit) == want
    assert len(set(asked)) <= 2 + len(sizes).bit_length()  # a binary search, not every k


def test_the_header_says_what_was_dropped_and_kept():
    text = Truncation(dropped_tokens=900, dropped_messages=6, kept_tokens=400, context_tokens=2048).header()
    assert "900 prompt tokens" in text and "6 older messages" in text and "2048" in text and "400" in text


# --- served -----------------------------------------------------------------------

LIMIT = 700  # the engine's prompt limit stands for a small context: the demo model's is 131,072


def engine_config(model, policy: str | None, per_model: str | None = None) -> str:
    spec = {"path": model, **({"context_overflow": per_model} if per_model else {})}
    return dumps({"embeddings": {}, "engine": {"max_tokens_cap": 64, "max_prompt_tokens": LIMIT,
                                               **({"context_overflow": policy} if policy else {}),
                                               "prompt_cache": {"disk": False}},
                  "models": {"demo-a": spec}, "aliases": {"default": "demo-a"}})


def conversation(turns_n: int) -> list[dict]:
    """An agent's long conversation: a system prompt, turns with a tool call and its result."""
    out = [{"role": "system", "content": "You are a careful coding agent. Keep answers short."}]
    for n in range(turns_n):
        out.append({"role": "user", "content": f"step {n}: " + "explain the build of module %d " % n * 6})
        out.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{n}", "type": "function", "function": {"name": "read", "arguments": f'{{"n": {n}}}'}}]})
        out.append({"role": "tool", "tool_call_id": f"call_{n}", "content": "file contents " * 10})
        out.append({"role": "assistant", "content": f"module {n} builds with make."})
    out.append({"role": "user", "content": "and now the last step?"})
    return out


def post(url: str, messages: list[dict], **extra) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": messages, "max_tokens": 8, "temperature": 0, **extra})


def test_truncate_middle_keeps_the_system_prompt_and_the_newest_turns_and_says_so(start_engine, demo_models):
    ep = start_engine(toml=engine_config(demo_models.a, "truncate_middle"))
    messages = conversation(12)
    r = post(ep.url, messages)
    assert r.status_code == 200, r.text[:300]
    usage = r.json()["usage"]
    dropped = usage["dropped_prompt_tokens"]
    assert dropped > 0 and usage["prompt_tokens"] <= LIMIT - answer_room(LIMIT + 1, 8)
    assert "dropped" in r.headers[TRUNCATED_HEADER]
    # What the model saw: the system prompt and whole newest turns -- the same prompt, sent short, is the
    # same prompt_tokens and (greedy) the same answer.
    for k in range(1, 13):
        short = [messages[0], *messages[1 + 4 * k:]]
        plain = post(ep.url, short)
        if TRUNCATED_HEADER not in plain.headers:  # the first cut that fits as sent
            break
    else:
        pytest.fail("no whole-turn cut of the conversation fits")
    assert plain.json()["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert "dropped_prompt_tokens" not in plain.json()["usage"]
    assert plain.json()["choices"][0]["message"] == r.json()["choices"][0]["message"]
    # the fewest turns dropped: with one turn fewer dropped it would not have fitted
    longer = [messages[0], *messages[1 + 4 * (k - 1):]]
    assert post(ep.url, longer).json()["usage"].get("dropped_prompt_tokens", 0) > 0


def test_truncate_middle_streamed_and_through_the_responses_and_messages_apis(start_engine, demo_models):
    ep = start_engine(toml=engine_config(demo_models.a, None, per_model="truncate_middle"))
    client = openai.OpenAI(base_url=ep.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=conversation(12), max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert "dropped" in raw.headers[TRUNCATED_HEADER.lower()]
    chunks = list(raw.parse())
    assert chunks[-1].usage.model_extra["dropped_prompt_tokens"] > 0
    raw = client.responses.with_raw_response.create(model="default", input=[
        {"type": "message", "role": "user", "content": "step %d: " % n + "explain the build " * 12} for n in range(12)
    ], max_output_tokens=8, temperature=0)
    assert "dropped" in raw.headers[TRUNCATED_HEADER.lower()]
    assert raw.parse().usage.model_extra["dropped_input_tokens"] > 0
    claude = anthropic.Anthropic(base_url=ep.url, api_key="x", max_retries=0)
    history = [{"role": "user" if n % 2 == 0 else "assistant", "content": "step %d: " % n + "explain the build " * 12}
               for n in range(23)]
    raw = claude.messages.with_raw_response.create(model="default", messages=history, max_tokens=8)
    assert "dropped" in raw.headers[TRUNCATED_HEADER.lower()]
    usage = raw.parse().usage
    assert usage.model_extra["dropped_input_tokens"] > 0 and usage.input_tokens <= LIMIT
    with claude.messages.stream(model="default", messages=history, max_tokens=8) as stream:
        assert "dropped" in stream.response.headers[TRUNCATED_HEADER.lower()]
        assert stream.get_final_message().usage.model_extra["dropped_input_tokens"] > 0


def test_error_stays_the_default_and_a_newest_turn_too_long_is_still_refused(start_engine, demo_models):
    ep = start_engine(toml=engine_config(demo_models.a, None))
    r = post(ep.url, conversation(12))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    ep2 = start_engine(toml=engine_config(demo_models.a, "truncate_middle"))
    r = post(ep2.url, [{"role": "system", "content": "s"}, {"role": "user", "content": "word " * (LIMIT + 50)}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    short = post(ep2.url, [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    assert short.status_code == 200 and TRUNCATED_HEADER not in short.headers  # short enough: nothing dropped
