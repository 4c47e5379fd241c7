"""Request metadata is not prompt: what agents write into the prompt text for a
hosted API's own servers is removed before the chat template.

Claude Code (since 2.1.36) starts every system prompt with a line for
Anthropic's billing, `x-anthropic-billing-header: cc_version=2.1.120.cf9;
cc_entrypoint=cli; cch=71fea;`, whose `cch` is a hash of the request and
changes every turn. Anthropic's servers lift it out; to any other server it is
the prompt's first tokens, so exact prefix reuse stops at token ~10 and every
turn prefills the whole conversation again (docs/BENCHMARKS.md, "Why the
engine is built as it is").
Removing it is what Claude Code does itself with
`CLAUDE_CODE_ATTRIBUTION_HEADER=0`, and what proxies in front of other
providers do.

What other agents change every turn is, as far as their issue trackers
show, meant for the model to read: the pi coding agent's "Current date and
time: ... 06:00:31 PM" at the end of its system prompt, date and working
directory lines, Claude Code's own `<system-reminder>` blocks, memory or
repository state folded into the system prompt. Those are instructions, not
metadata: they stay, and the prompt cache deals with them (a turn that
continues a conversation replaces its entry; opt-in approximate reuse goes
past a changed value: engine/cache/reuse.py). Each rule here is matched
narrowly, on the role it is sent in, so that nothing else the model sees
changes. `[engine] strip_metadata` lists the rules in force (all by default;
`[]` turns it off).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from .chat_messages import ChatMessage, TextPart


@dataclass(frozen=True)
class MetadataRule:
    pattern: re.Pattern[str]
    roles: frozenset[str]  # the message roles it is looked for in


RULES: dict[str, MetadataRule] = {
    # One line of `key=value;` pairs at the start of a system text (the whole of
    # its own block on the Anthropic route). Matched pair by pair, not to the end
    # of the line: where a client joins blocks without a newline, the text that
    # follows the header is kept.
    "claude_code_billing_header": MetadataRule(
        re.compile(r"\Ax-anthropic-billing-header:(?:[ \t]*[A-Za-z_][A-Za-z0-9_]*=[^;\n]*;)+[ \t]*(?:\r?\n)*"),
        frozenset({"system", "developer"})),
}
DEFAULT_RULES = tuple(RULES)


def strip_text(text: str, role: str, rules: Sequence[str]) -> str:
    """`text` of a message in `role` with the named rules' metadata removed (pure)."""
    for name in rules:
        rule = RULES[name]
        if role in rule.roles:
            text = rule.pattern.sub("", text, count=1)
    return text


def strip_parts(parts: Sequence[str], role: str, rules: Sequence[str]) -> list[str | None]:
    """The text parts of one message, each stripped; a part that held nothing
    but metadata becomes None (dropped), so no empty block is left (pure).
    Metadata is looked for at the start of the message's first text only,
    where agents put it."""
    out: list[str | None] = []
    for i, part in enumerate(parts):
        if i == 0:
            stripped = strip_text(part, role, rules)
            out.append(stripped if stripped or not part else None)
        else:
            out.append(part)
    return out


def without_metadata(messages: list[ChatMessage], rules: Sequence[str]) -> list[ChatMessage]:
    """The request's messages with the rules' metadata removed (pure: new
    message objects where something changed, the others as they were)."""
    if not rules:
        return messages
    out = []
    for m in messages:
        if isinstance(m.content, str):
            text = strip_text(m.content, m.role, rules)
            if text != m.content and not text:
                continue  # a message of metadata alone is no message (as with the client's own switch off)
            out.append(m if text == m.content else m.model_copy(update={"content": text}))
            continue
        texts = [p for p in m.content or [] if isinstance(p, TextPart)]
        if not texts:
            out.append(m)
            continue
        kept = dict(zip(map(id, texts), strip_parts([p.text for p in texts], m.role, rules)))
        if all(kept[id(p)] == p.text for p in texts):
            out.append(m)
            continue
        parts = [p if not isinstance(p, TextPart) else p.model_copy(update={"text": kept[id(p)]})
                 for p in m.content or [] if not (isinstance(p, TextPart) and kept[id(p)] is None)]
        if parts:
            out.append(m.model_copy(update={"content": parts}))
    return out
