"""A conversation longer than the model's context: refused, or its middle
dropped (pure).

`context_overflow = "error"` (the default) answers 400
`context_length_exceeded`, as today, and the gateway may send the request to
a fallback with a longer context. `"truncate_middle"` keeps what an agent
cannot do without -- the system prompt(s), the tool definitions (they are not
messages: the chat template renders them whatever is dropped) and the newest
turn -- and drops whole older turns, oldest first, until the prompt fits with
room for the answer. A turn is a user message and everything after it up to
the next one (the assistant's answers, its tool calls and their results), so
a tool call is never kept without its result or the other way round. What
was dropped is said: a response header and a usage field (engine/api/relay.py),
never silently as Ollama's truncation does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SYSTEM_ROLES = ("system", "developer")
TRUNCATED_HEADER = "X-Mlxd-Context-Truncated"


@dataclass(frozen=True)
class Truncation:
    """What truncate_middle dropped from one prompt."""

    dropped_tokens: int
    dropped_messages: int
    kept_tokens: int
    context_tokens: int | None  # the model's (None: not known; the engine's prompt limit applied)

    def header(self) -> str:
        fit = f" to fit the model's context of {self.context_tokens} tokens" if self.context_tokens else ""
        return (f"dropped {self.dropped_tokens} prompt tokens ({self.dropped_messages} older messages, whole turns)"
                f"{fit}; kept the system prompt, the tools and the newest turns ({self.kept_tokens} tokens)")


def turns(messages: Sequence[dict[str, Any]]) -> list[list[int]]:
    """The droppable turns, oldest first, as lists of message indices: each
    user message opens one; system and developer messages belong to none
    (they are kept wherever they are); messages before the first user
    message are the first turn's."""
    out: list[list[int]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in SYSTEM_ROLES:
            continue
        if role == "user" or not out:
            out.append([i])
        else:
            out[-1].append(i)
    return out


def without_oldest(messages: Sequence[dict[str, Any]], groups: list[list[int]], k: int) -> list[dict[str, Any]]:
    """`messages` less the oldest `k` turns."""
    dropped = {i for group in groups[:k] for i in group}
    return [m for i, m in enumerate(messages) if i not in dropped]


def answer_room(context_tokens: int, max_tokens: int) -> int:
    """Tokens kept free for the answer when a prompt is cut to fit (pure):
    what the request asks for, but never more than a quarter of the context
    (a request that leaves its max_tokens at a large default still gets most
    of its conversation)."""
    return max(1, min(max_tokens, context_tokens // 4))


def fewest_turns_to_drop(count: Callable[[int], int], n_turns: int, limit: int) -> int | None:
    """The fewest oldest turns whose removal brings the prompt to `limit`
    tokens or fewer, never the newest turn (pure but for `count(k)`, the
    prompt's tokens without the oldest k turns, which never grows with k:
    a binary search, log2(turns) renderings); None when even all but the
    newest are not enough."""
    if n_turns <= 1 or count(n_turns - 1) > limit:
        return None
    low, high = 1, n_turns - 1  # count(0) > limit is the caller's reason to be here
    while low < high:
        mid = (low + high) // 2
        if count(mid) <= limit:
            high = mid
        else:
            low = mid + 1
    return low
