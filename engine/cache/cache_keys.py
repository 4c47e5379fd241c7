"""Agent-safe cache keys: which conversation a request continues, with the
volatile text agents change every turn ignored.

Agents stamp their prompts with things that change every turn: the current
time in the system prompt, a fresh request or message id. KV depends on every
earlier token, so a changed token ends the reuse there, whatever we do, and
the model must always see the real text. What normalising does is tell the
cache that turn N and turn N-1 are the same conversation: turn N's entry then
replaces turn N-1's instead of piling up beside it, so memory and disk keep
one entry per live conversation (and other conversations alive) rather than
one per turn. The reuse itself still stops at the first real token that
differs.

Off unless `[engine.prompt_cache] normalize` names rules; each rule is a
regular expression whose matches are replaced by a placeholder.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Sequence

RULES: dict[str, re.Pattern[str]] = {
    # 2026-11-23T10:31:02Z, 2026-11-23 10:31, 2026-11-23T10:31:02.123+01:00
    "iso_timestamps": re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"),
    # 10:31, 10:31:02, 9:05 PM
    "clock_times": re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?\b"),
    # 123e4567-e89b-12d3-a456-426614174000
    "uuids": re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    # req_8f3a..., msg_01Xy..., call_abc123..., toolu_..., chatcmpl-..., run_..., and long bare hex ids
    "request_ids": re.compile(r"\b(?:(?:req|msg|call|toolu|chatcmpl|run|thread|resp)[_-][A-Za-z0-9]{6,}"
                              r"|[0-9a-f]{16,})\b"),
}


def normalize(text: str, rules: Sequence[str]) -> str:
    """`text` with every match of the named rules replaced by ⟨rule⟩ (pure)."""
    for name in rules:
        text = RULES[name].sub(f"⟨{name}⟩", text)
    return text


def conversation_keys(messages: list[dict[str, Any]] | None, tools: list[dict] | None,
                      rules: Sequence[str]) -> tuple[str, ...]:
    """One short hash per message (the tools count as the first), of the
    normalised message: a request continues an earlier one when the earlier
    one's keys are a prefix of its own (pure). Empty without rules or messages."""
    if not rules or not messages:
        return ()
    parts = [tools or []] + list(messages)
    return tuple(hashlib.sha256(normalize(json.dumps(p, sort_keys=True, ensure_ascii=False, default=str),
                                          rules).encode()).hexdigest()[:12] for p in parts)


def continues(earlier: Sequence[str], later: Sequence[str]) -> bool:
    """Whether a request with keys `later` continues one with keys `earlier` (pure)."""
    return bool(earlier) and len(earlier) <= len(later) and tuple(later[:len(earlier)]) == tuple(earlier)
