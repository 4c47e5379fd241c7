"""Request metadata is removed before the chat template, and nothing else:
the rules as a table, and the request messages they are applied to."""

from __future__ import annotations

import pytest

from mlxd.engine.api.chat_messages import ChatMessage
from mlxd.engine.api.request_metadata import DEFAULT_RULES, strip_parts, strip_text, without_metadata

HEADER = "x-anthropic-billing-header: cc_version=2.1.120.cf9; cc_entrypoint=cli; cch=71fea;"
RULE = ["claude_code_billing_header"]


@pytest.mark.parametrize("text, role, expected", [
    # Claude Code's system prompt: the header line goes, the prompt stays
    (f"{HEADER}\nYou are Claude Code.", "system", "You are Claude Code."),
    (f"{HEADER}\n\nYou are Claude Code.", "system", "You are Claude Code."),
    (f"{HEADER}\r\nYou are Claude Code.", "system", "You are Claude Code."),
    # blocks joined without a newline: only the header's own key=value; pairs go
    (f"{HEADER}You are Claude Code.", "system", "You are Claude Code."),
    (f"{HEADER} You are Claude Code.", "system", "You are Claude Code."),
    # other versions and fields, any order
    ("x-anthropic-billing-header: cc_version=2.0.1; cch=00000;\nHi", "system", "Hi"),
    ("x-anthropic-billing-header: cc_entrypoint=sdk-cli; cc_version=2.1.177.01c; cch=36ee5; cc_workload=x;\nHi",
     "developer", "Hi"),
    # the header alone
    (HEADER, "system", ""),
    # only at the start of a system text: quoted in a user message or later in the prompt, it is content
    (f"{HEADER}\nWhy is this in my prompt?", "user", f"{HEADER}\nWhy is this in my prompt?"),
    (f"You are helpful.\n{HEADER}\n", "system", f"You are helpful.\n{HEADER}\n"),
    # not the header's shape: left alone
    ("x-anthropic-billing-header: none\nHi", "system", "x-anthropic-billing-header: none\nHi"),
    ("X-Anthropic-Billing-Header: cch=1;\nHi", "system", "X-Anthropic-Billing-Header: cch=1;\nHi"),
])
def test_strip_text(text, role, expected):
    assert strip_text(text, role, RULE) == expected


def test_no_rules_keep_everything():
    assert strip_text(f"{HEADER}\nHi", "system", []) == f"{HEADER}\nHi"


def test_every_rule_is_on_by_default():
    assert set(DEFAULT_RULES) == {"claude_code_billing_header"}


def test_strip_parts_drops_a_block_of_metadata_alone_and_keeps_later_blocks_as_they_are():
    assert strip_parts([HEADER, "You are Claude Code.", HEADER], "system", RULE) == \
        [None, "You are Claude Code.", HEADER]
    assert strip_parts(["", "x"], "system", RULE) == ["", "x"]  # an empty block is not metadata


def msg(role, content):
    return ChatMessage.model_validate({"role": role, "content": content})


def test_without_metadata_on_request_messages():
    messages = [
        msg("system", [{"type": "text", "text": HEADER}, {"type": "text", "text": "You are Claude Code."}]),
        msg("user", f"{HEADER}\nquoted"),
        msg("assistant", "ok"),
    ]
    out = without_metadata(messages, RULE)
    assert [m.for_template() for m in out] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": f"{HEADER}\nquoted"},
        {"role": "assistant", "content": "ok"},
    ]
    assert out[1] is messages[1] and out[2] is messages[2]  # untouched messages are the same objects
    # a system message of the header alone is no message; with no rules nothing changes
    assert [m.role for m in without_metadata([msg("system", HEADER), msg("user", "hi")], RULE)] == ["user"]
    assert without_metadata(messages, []) is messages
