"""The prompt cache's per-turn plan (pure): which cached entry a prompt
reuses, how deep, whether the turn continues that entry's conversation (and
so replaces it) or branches from it, and, with approximate reuse, which
changed spans are recomputed over the reused KV.

Exact reuse stops at the first token that differs: a KV value depends on
every token before it. Agents put volatile values inside the prompt (a clock
in the system prompt, ids), so a turn can share 95 % of its tokens with the
last one and still reuse only the part before the first change. Approximate
reuse (opt-in, `[engine.prompt_cache] approximate`) keeps the cached KV past
such a change when the two prompts stay aligned token for token: the changed
tokens are recomputed over the cached KV before them (CacheBlend's selective
recomputation, at its simplest: the changed spans and a few tokens after
each), and the tokens after a change keep KV computed with the old value in
view. The model then attends to KV from text it was not sent, which is why
it is off by default and its effect on answers is measured
(bench/approx_reuse_quality.py, docs/BENCHMARKS.md).

The plan is also what `mlxd status` shows per conversation: where exact
reuse stopped and why (mlxd.reports' `ReuseLine`, as /health reports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .cache_keys import continues

# Diffs closer than this are one span to recompute (a clock's digits).
MERGE_GAP = 8
# Tokens after the entry's prompt that must match the new prompt's, where
# earlier client tokens changed, for the turn to count as the same
# conversation (its answer came back): without it two sub-agents whose
# prompts differ in a few tokens would replace each other's entries.
ANSWER_CHECK = 4
MAX_CHANGED = 64  # changed tokens a turn of the same conversation may have, at most (bounds the walk's cost)
# Realigning after a changed span: this many tokens must agree again, within
# this many tokens of where the change began on either side.
RESYNC_TOKENS = 8
MAX_SHIFT = 8
# An edit too large to walk past (an old tool result cleared) still continues
# the conversation when the entry's last prompt tokens, up to this many (and
# at least MIN_TAIL_ANCHOR), and its answer come later in the prompt.
TAIL_ANCHOR = 64
MIN_TAIL_ANCHOR = 16


@dataclass(frozen=True, eq=False)  # eq=False: identity, never an elementwise compare of token arrays
class Candidate:
    """What the plan needs to know about an entry (Entry and DiskEntry
    have these fields)."""

    tokens: np.ndarray  # the tokens its KV covers
    prompt_len: int  # how many of them a client sent (the rest were generated)
    trimmable: bool
    patchable: bool = False  # every layer a plain KVCache: spans inside can be recomputed
    echo: tuple[int, ...] = ()  # how its answer's first tokens come back in the next prompt (re-encoded text)


@dataclass(frozen=True)
class ApproxPolicy:
    """Approximate reuse's limits."""

    max_changed_share: float = 0.10  # recomputed tokens, at most this share of the reused KV
    recompute_after: int = 4  # tokens after each changed span recomputed too (they attend to it most)


@dataclass(frozen=True)
class Reuse:
    index: int  # the candidate reused
    tokens: int  # prompt tokens its KV covers once patched: the prefill starts here
    trim: int  # tokens cut off the entry's end first
    copy: bool  # use a copy and keep the entry: another conversation branched from it
    exact: int  # the exact common prefix with the prompt
    patches: tuple[tuple[int, int], ...] = ()  # spans [start, end) recomputed (approximate reuse)

    @property
    def recomputed(self) -> int:
        return sum(end - start for start, end in self.patches)

    @property
    def reused(self) -> int:
        """Prompt tokens whose KV comes from the cache (usage's cached_tokens)."""
        return self.tokens - self.recomputed


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _run_length(a: np.ndarray, b: np.ndarray, i: int, j: int) -> int:
    """How many tokens agree from a[i] and b[j] on, compared in growing
    chunks: a walk past many small changes stays linear in the prompt."""
    n, done, chunk = min(len(a) - i, len(b) - j), 0, 64
    while done < n:
        k = min(chunk, n - done)
        differ = np.flatnonzero(a[i + done:i + done + k] != b[j + done:j + done + k])
        if len(differ):
            return done + int(differ[0])
        done, chunk = done + k, chunk * 4
    return n


def max_changed(prompt_len: int) -> int:
    """Client tokens that may differ, aligned, in a turn of the same
    conversation: a clock, an id, a few values."""
    return min(MAX_CHANGED, max(16, prompt_len // 50))


def walk_changes(a: np.ndarray, b: np.ndarray, budget: int) -> tuple[int, int] | None:
    """Walks `a` and `b` together past small changed spans, each of which may
    change length (a clock's `9:59` becoming `10:00`): (tokens of `a`
    changed, where `a`'s end falls in `b`), or None when more than `budget`
    tokens changed or the two part for good (pure). After a change the walk
    goes on at the nearest point where RESYNC_TOKENS tokens agree again,
    each side at most MAX_SHIFT tokens on."""
    i = j = changed = 0
    while True:
        k = _run_length(a, b, i, j)
        i, j = i + k, j + k
        if i >= len(a):
            return changed, j
        step = _resync(a, b, i, j)
        if step is None:
            return None
        changed += max(step)
        if changed > budget:
            return None
        i, j = i + step[0], j + step[1]


def _resync(a: np.ndarray, b: np.ndarray, i: int, j: int) -> tuple[int, int] | None:
    """The smallest skip (on a, on b) after which the two agree again."""
    for total in range(1, 2 * MAX_SHIFT + 1):
        for da in range(max(0, total - MAX_SHIFT), min(total, MAX_SHIFT) + 1):
            db = total - da
            w = min(RESYNC_TOKENS, len(a) - (i + da))
            if w < 0 or j + db + w > len(b):
                continue
            if w == 0 or np.array_equal(a[i + da:i + da + w], b[j + db:j + db + w]):
                return da, db
    return None


def continues_conversation(c: Candidate, prompt: np.ndarray, generation_prompt: int = 0) -> bool:
    """Whether `prompt` is a later turn of the conversation whose entry `c`
    is, so that the turn replaces it (pure). Yes when it starts with all of
    the entry's prompt, but for the template's generation prompt
    (`generation_prompt` tokens, which a reasoning template renders
    differently in history); or when it holds the entry's prompt with a few
    values changed (`max_changed`, `walk_changes`) and the entry's answer
    came back right after it; or, past a larger edit of its history, when
    the entry's last prompt tokens and its answer come later in it."""
    p = c.prompt_len
    own = c.tokens[:p]
    shared = common_prefix(own, prompt)
    if len(prompt) >= p and shared >= p - generation_prompt:
        return True
    answer = np.asarray(c.echo[:ANSWER_CHECK] if c.echo else c.tokens[p:p + ANSWER_CHECK], dtype=np.int32)
    walked = walk_changes(own, prompt, max_changed(p))
    if walked is not None:
        end = walked[1]
        k = min(len(answer), len(prompt) - end)
        return k > 0 and bool(np.array_equal(answer[:k], prompt[end:end + k]))
    # History edited in between (an old tool result cleared): the entry's last
    # message and its answer still come later in the prompt.
    tail = own[max(p - TAIL_ANCHOR, shared + 1):]
    return len(answer) > 0 and len(tail) >= MIN_TAIL_ANCHOR and \
        find_tokens(prompt[shared + 1:], np.concatenate([tail, answer])) >= 0


def find_tokens(haystack: np.ndarray, needle: np.ndarray) -> int:
    """Where `needle` first occurs in `haystack`, or -1 (pure; a bytes search
    at C speed, kept to whole tokens)."""
    hay, pin = haystack.astype("<i4").tobytes(), needle.astype("<i4").tobytes()
    at = hay.find(pin)
    while at >= 0 and at % 4:
        at = hay.find(pin, at + 1)
    return at // 4 if at >= 0 else -1


def patch_plan(cached: np.ndarray, prompt: np.ndarray, limit: int,
               policy: ApproxPolicy) -> tuple[int, tuple[tuple[int, int], ...]]:
    """How far the cached tokens can serve `prompt` with changed spans
    recomputed (pure): (end, spans), the end that leaves the fewest tokens to
    compute (recomputed + prefilled after `end`), never past `limit`. The
    tokens compared are aligned position by position: a change of length
    shifts everything after it, and reuse then stops at the change."""
    n = min(len(cached), limit)
    differ = np.flatnonzero(cached[:n] != prompt[:n])
    if not len(differ):
        return n, ()
    best_end, best_spans = int(differ[0]), ()
    spans: list[tuple[int, int]] = []
    recomputed, i = 0, 0
    while i < len(differ):
        j = i
        while j + 1 < len(differ) and differ[j + 1] - differ[j] <= MERGE_GAP:
            j += 1
        start, end = int(differ[i]), min(int(differ[j]) + 1 + policy.recompute_after, n)
        if spans and start <= spans[-1][1]:  # the last span's extra tokens reach this one
            start, recomputed = spans[-1][0], recomputed - (spans[-1][1] - spans[-1][0])
            spans.pop()
        spans.append((start, end))
        recomputed += end - start
        run_end = int(differ[j + 1]) if j + 1 < len(differ) else n
        run_end = max(run_end, end)
        if recomputed <= policy.max_changed_share * run_end and run_end - recomputed > best_end - _cost(best_spans):
            best_end, best_spans = run_end, tuple(spans)
        i = j + 1
    return best_end, best_spans


def _cost(spans: Sequence[tuple[int, int]]) -> int:
    return sum(end - start for start, end in spans)


def choose_reuse(candidates: Sequence[Candidate], prompt: np.ndarray, min_tokens: int = 1,
                 generation_prompt: int = 0, approximate: ApproxPolicy | None = None) -> Reuse | None:
    """The entry that saves most of `prompt`'s prefill, or None (pure).

    At least the prompt's last token is always left to prefill: its logits
    start the answer. A trimmable entry is cut back to the shared prefix (or,
    with `approximate`, to the end of its aligned part, changed spans
    recomputed); one that cannot be trimmed is reused only when all of it is
    a prefix of the prompt, never at a wrong depth. Candidates come least
    recently used first; on a tie the most recent wins. Approximate reuse
    goes past a change only in a later turn of the entry's conversation. An
    entry is continued in place when the prompt continues its conversation
    (`continues_conversation`): the turn replaces it. Otherwise another
    conversation branched from it, so it stays and a copy is used. Less than
    `min_tokens` is not worth it (a chat template's opening tokens are
    shared by every conversation)."""
    limit = len(prompt) - 1
    best: Reuse | None = None
    for i, c in enumerate(candidates):
        shared = common_prefix(c.tokens, prompt)
        if shared < max(min_tokens, 1) and (approximate is None or not c.patchable):
            continue  # nothing to reuse (and the conversation test walks the whole prompt: skipped)
        same_conversation = continues_conversation(c, prompt, generation_prompt)
        patches: tuple[tuple[int, int], ...] = ()
        if c.trimmable:
            usable = min(shared, limit)
            # Past a change only within one conversation (its clock moved on): another
            # conversation's text that differs in a few tokens may be its very task.
            if (approximate is not None and c.patchable and same_conversation
                    and usable < min(len(c.tokens), limit)):
                usable, patches = patch_plan(c.tokens, prompt, limit, approximate)
        else:
            usable = len(c.tokens) if shared == len(c.tokens) <= limit else 0
        saved = usable - _cost(patches)
        if usable >= max(min_tokens, 1) and (best is None or saved >= best.reused):
            best = Reuse(i, usable, len(c.tokens) - usable, copy=not same_conversation,
                         exact=min(shared, limit), patches=patches)
    return best


def supersedes(new: Any, old: Any) -> bool:
    """Whether `old` only takes room once `new` is kept (pure; both have
    tokens, trimmable, conversation, as Entry and DiskEntry do): a prefix of
    a trimmable `new`, which can be cut back to serve it, or, with agent-safe
    keys, an earlier turn of its conversation."""
    prefix = (new.trimmable and len(old.tokens) <= len(new.tokens)
              and common_prefix(old.tokens, new.tokens) == len(old.tokens))
    return prefix or continues(old.conversation, new.conversation)


def explain(reuse: Reuse | None, candidate: Candidate | None, prompt_len: int, entries: int) -> tuple[int | None, str]:
    """(stopped_at, why) for a turn's plan (pure)."""
    if reuse is None:
        return (0, "nothing cached for this model yet") if not entries else (0, "no cached prompt shares its start")
    assert candidate is not None
    limit = prompt_len - 1
    if reuse.patches:
        return reuse.exact, (f"prompt differs at token {reuse.exact}; {len(reuse.patches)} changed span(s), "
                             f"{reuse.recomputed} tokens recomputed (approximate)")
    if reuse.exact >= limit:
        return None, "all but the last prompt token reused"
    if reuse.exact >= len(candidate.tokens):
        return reuse.exact, f"the cached conversation ends at token {reuse.exact}; the rest is new"
    if reuse.exact >= candidate.prompt_len:
        return reuse.exact, (f"the answer came back different from what was generated, at token {reuse.exact} "
                             f"(a template that drops reasoning, or edited history)")
    return reuse.exact, f"prompt differs from the cached conversation at token {reuse.exact}"
