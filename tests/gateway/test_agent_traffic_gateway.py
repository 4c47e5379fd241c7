"""Claude Code's traffic through the whole service: its per-request billing
header on top of the system prompt must not cost the prompt cache, on the
Anthropic route (`/v1/messages`, the official `anthropic` client, the header
as its own system block) and on the OpenAI route (the header as the system
prompt's first line); `mlxd status` shows where each conversation's reuse
stopped."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

pytestmark = pytest.mark.timeout(300)
SYSTEM = "You are Claude Code, a coding agent; read files before you change them. " * 25  # ~500 tokens
SLOW_PREFILL = "stuck_grace_s = 30\n"  # a long prefill takes seconds on this CPU
TURNS = 3


def billing_header(turn: int) -> str:
    """Claude Code's line: its cch changes every request."""
    return f"x-anthropic-billing-header: cc_version=2.1.120.cf9; cc_entrypoint=cli; cch={0x3a7f1 * turn % 0xfffff:05x};"


@pytest.fixture(scope="module")
def st(module_stack):
    return module_stack(engine=SLOW_PREFILL, gateway="")


def test_claude_code_on_the_messages_route_reuses_its_prompt_from_turn_two(st):
    client = anthropic.Anthropic(base_url=st.gateway_url, api_key=st.key, max_retries=0, timeout=120)
    messages: list[dict] = []
    shares = []
    for turn in range(1, TURNS + 1):
        messages.append({"role": "user", "content": f"step {turn}: list the files you would read"})
        answer = client.messages.create(
            model="default", max_tokens=6, extra_body={"temperature": 0}, messages=messages,
            system=[{"type": "text", "text": billing_header(turn)}, {"type": "text", "text": SYSTEM}])
        u = answer.usage
        cached = u.cache_read_input_tokens or 0
        shares.append(cached / (u.input_tokens + cached))
        messages.append({"role": "assistant", "content": "".join(b.text for b in answer.content if b.type == "text")
                         or "ok"})
    assert shares[0] == 0 and all(s >= 0.9 for s in shares[1:]), shares


def test_claude_code_on_the_openai_route_reuses_its_prompt_and_status_says_where(st):
    client = openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=120)
    messages: list[dict] = []
    for turn in range(1, TURNS + 1):
        system = {"role": "system", "content": f"{billing_header(turn)}\n{SYSTEM}"}
        messages.append({"role": "user", "content": f"step {turn}: which test fails?"})
        answer = client.chat.completions.create(model="default", messages=[system, *messages], max_tokens=6,
                                                temperature=0)
        if turn > 1:
            u = answer.usage
            assert u.prompt_tokens_details.cached_tokens >= 0.9 * u.prompt_tokens, (turn, u)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    status = st.mlxd("status").stdout
    assert "conversation  prompt  reused  stopped at  why" in status, status
    recent = json.loads(st.mlxd("status", "--json").stdout)["engine"]["health"]["prompt_cache"]["recent"]
    last = recent[-1]
    assert last["prompt_tokens"] == answer.usage.prompt_tokens and last["cached_tokens"] >= 0.9 * last["prompt_tokens"]
    assert f"{last['conversation']:<12}  {last['prompt_tokens']:>6}  {last['cached_tokens']:>6}" in status
