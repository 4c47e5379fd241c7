"""The prompt cache through the whole service: cached_tokens intact through
the gateway (the engine fast path and the LiteLLM path, streamed and not),
and a conversation whose engine dies by SIGABRT mid-turn answered from its
disk entry by the restarted engine."""

from __future__ import annotations

import json
import os
import signal

import openai
import pytest
import requests

from testkit import wait_until

pytestmark = pytest.mark.timeout(300)
SYSTEM = "You are the release assistant of the mlxd project; answer briefly. " * 25
POISON = "boom"  # the injected fault fires only for prompts with this word
# A 1000-token prefill takes seconds on this CPU: more than the tests' usual 1 s stuck grace.
SLOW_PREFILL = "stuck_grace_s = 30\n"


def conversation(*turns: str) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return messages


def usage_of(client: openai.OpenAI, messages: list[dict], stream: bool):
    kw = dict(model="default", messages=messages, max_tokens=6, temperature=0)
    if not stream:
        answer = client.chat.completions.create(**kw)
        return answer.choices[0].message.content, answer.usage
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, next(c.usage for c in chunks if c.usage)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm-path"])
def test_cached_tokens_arrive_intact_through_the_gateway(stack, fast_path):
    st = stack(gateway=f"engine_fast_path = {str(fast_path).lower()}", engine=SLOW_PREFILL)
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)
    reply, first = usage_of(client, conversation("what is mlxd?"), stream=False)
    assert first.prompt_tokens_details.cached_tokens == 0
    for stream in (False, True):
        messages = conversation("what is mlxd?", reply, f"and then ({stream})?")
        reply2, usage = usage_of(client, messages, stream)
        # What the engine reported, unchanged: the engine's /health counts the same tokens.
        assert usage.prompt_tokens_details.cached_tokens > 0.8 * usage.prompt_tokens, (stream, usage)
    stats = requests.get(st.url + "/health", timeout=5).json()["prompt_cache"]
    assert stats["hits"] == 2 and stats["requests"] == 3
    if fast_path:  # what an operator sees, once
        assert "(2/3 requests hit)" in st.mlxd("status").stdout
        assert json.loads(st.mlxd("status", "--json").stdout)["engine"]["health"]["prompt_cache"]["hits"] == 2
        metrics = requests.get(st.url + "/metrics", timeout=5).text
        assert "mlxd_engine_prompt_cache_hits 2.0" in metrics


def test_after_a_sigabrt_mid_turn_the_next_turn_comes_from_disk(stack):
    st = stack(env={"MLXD_FAULT_MATCH": POISON}, gateway="", engine=SLOW_PREFILL)
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)
    reply, _ = usage_of(client, conversation("turn one"), stream=False)
    health = lambda: requests.get(st.url + "/health", timeout=5).json()  # noqa: E731
    wait_until(lambda: health()["prompt_cache"]["disk_entries"] >= 1, 30, what="the idle write")
    pid = st.engine_pid()
    st.fault_file.write_text("abort@token:1")
    # The engine aborts on this turn (the gateway answers it from the fallback or fails it; either way
    # the engine is gone).
    try:
        usage_of(client, conversation("turn one", reply, f"turn two {POISON}"), stream=False)
    except openai.APIError:
        pass
    st.fault_file.unlink()
    wait_until(lambda: st.engine_pid() not in (None, pid) and st.healthy(), 60, what="the restarted engine")
    assert any(r.signal == "SIGABRT" for r in st.records())
    _, usage = usage_of(client, conversation("turn one", reply, "turn two, again"), stream=False)
    assert usage.prompt_tokens_details.cached_tokens > 300
    assert health()["prompt_cache"]["disk_hits"] == 1


def test_a_sigabrt_right_after_each_answer_costs_the_next_turn_almost_nothing(stack):
    """Each turn's KV is on disk as it is made (its prompt's once its first
    token is out, its answer's right after it): an engine killed the moment
    an answer arrives, every turn, leaves the next turn ≥ 90 % of its prompt
    cached. (Before write-behind, the latest entry reached disk only after
    0.25 s idle: the next turn reused nothing.)"""
    st = stack(gateway="", engine=SLOW_PREFILL)
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)
    turns = ["turn one"]
    for n in range(2, 6):
        reply, usage = usage_of(client, conversation(*turns), stream=n % 2 == 0)
        if n > 2:
            assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, (n, usage)
        pid = st.engine_pid()
        os.kill(pid, signal.SIGABRT)  # at once: no idle moment for the engine to write anything more
        wait_until(lambda: st.engine_pid() not in (None, pid) and st.healthy(), 60, what="the restarted engine")
        turns += [reply, f"turn {n}"]
    _, usage = usage_of(client, conversation(*turns), stream=False)
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, usage
    assert requests.get(st.url + "/health", timeout=5).json()["prompt_cache"]["disk_hits"] == 1  # this process's
    assert sum(1 for r in st.records() if r.signal == "SIGABRT") == 4
