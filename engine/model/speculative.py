"""Speculative decoding by prompt lookup, for the one-row decoder (exact).

An agent's answer re-emits long spans of its context: an edit rewrites a file
the prompt holds, a tool call's arguments repeat paths and code. Prompt lookup
(llama.cpp's n-gram speculation; transformers' `prompt_lookup_num_tokens`)
proposes the tokens that followed the last few tokens' latest earlier
occurrence in the prompt and the answer so far, and the model verifies them
in one forward (one_row.verify_greedy): the longest prefix it would have
chosen itself is kept, then its own next token. Greedy answers are the same
tokens, one to k + 1 of them per forward.

The decisions are pure: `NgramIndex` (where the suffix occurred before),
`DraftLength` (how many tokens to propose: more while they are accepted, one
after a miss, none for a while after misses in a row, so text with nothing to
copy pays almost nothing). `lookup_steps` is the generator the one-row
decoder pulls tokens from, as it pulls them from mlx-lm's `generate_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

NGRAM_MAX = 3  # the longest suffix looked up; longer matches are rarer and barely more precise
NGRAM_MIN = 2
DRAFT_MAX = 8  # tokens proposed at most per forward
PAUSE_AFTER_MISSES = 3  # proposals rejected outright in a row before a pause
PAUSE_STEPS = 8  # plain decode steps of a first pause; each pause in a row doubles it, up to PAUSE_MAX
PAUSE_MAX = 128


class NgramIndex:
    """Where each n-gram (NGRAM_MIN..NGRAM_MAX tokens) of a token history last
    occurred with at least one token after it: `propose` looks up the
    history's own suffix and returns what followed it there."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        history, after = self.tokens, self._after
        for token in tokens:
            end = len(history)  # the new token's index: it follows the n-grams ending just before it
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end >= n:
                    after[tuple(history[end - n:end])] = end
            history.append(token)

    def propose(self, k: int) -> list[int]:
        """`k` tokens that followed the latest earlier occurrence of the
        longest suffix found (NGRAM_MAX tokens down to NGRAM_MIN); none if it
        never occurred."""
        if k <= 0:
            return []
        history = self.tokens
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(history) <= n:
                continue
            start = self._after.get(tuple(history[-n:]))
            if start is not None:
                # Running into the history's end, the match overlaps the suffix: the text repeats with the period
                # between them, and the proposal goes on repeating it (a run of one token, a loop of a few).
                period = len(history) - start
                out: list[int] = []
                for i in range(k):
                    out.append(history[start + i] if start + i < len(history) else out[i - period])
                return out
        return []


@dataclass
class DraftLength:
    """How many tokens to propose next (pure state): doubled while whole
    proposals are accepted (to DRAFT_MAX), one more than was accepted after a
    partial miss, and after PAUSE_AFTER_MISSES proposals rejected outright a
    pause of plain steps that doubles while the misses go on."""

    k: int = 4
    misses: int = 0
    paused: int = 0  # plain steps left in the current pause
    pause: int = PAUSE_STEPS

    def next_k(self) -> int:
        """Tokens to propose at this step (0: a plain step)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.k

    def saw(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted == proposed:
            self.k, self.misses, self.pause = min(DRAFT_MAX, self.k * 2), 0, PAUSE_STEPS
        elif accepted > 0:
            self.k, self.misses = max(1, accepted + 1), 0
        else:
            self.k, self.misses = 1, self.misses + 1
            if self.misses >= PAUSE_AFTER_MISSES:
                self.paused, self.misses, self.pause = self.pause, 0, min(PAUSE_MAX, self.pause * 2)


@dataclass
class SpecStats:
    """What speculation did for one request: for the log and /metrics."""

    forwards: int = 0  # forward passes of the decode (verifies and plain steps)
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens the forwards produced
    history: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted) per verify, for tests

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0


def lookup_steps(model: Any, kv: list[Any], rest: list[int], context: Sequence[int], max_tokens: int,
                 stats: SpecStats, verify: Callable[[Any, list[Any], int, list[int]], list[int]]) -> Iterator[tuple[int, None]]:
    """Greedy tokens, as mlx-lm's generate_step yields them ((token, None)):
    `rest` (the prompt's last token or tokens, their KV not in `kv` yet) first,
    then prompt-lookup proposals verified `verify(model, kv, last, proposed)`
    (one_row.verify_greedy) or, with nothing to propose, a plain step. A
    proposal never runs past `max_tokens`, so the KV allocated at admission
    is never outgrown."""
    import mlx.core as mx

    logits = model(mx.array([rest], dtype=mx.int32), cache=kv)
    last = int(mx.argmax(logits[0, -1]).item())
    stats.forwards += 1
    stats.tokens += 1
    produced = 1
    yield last, None  # the first token before the index is built: its time is not in the TTFT
    index = NgramIndex([*context, *rest, last])
    draft = DraftLength()
    while produced < max_tokens:
        k = min(draft.next_k(), max_tokens - produced - 1)
        proposed = index.propose(k) if k > 0 else []
        if proposed:
            out = verify(model, kv, last, proposed)
            accepted = len(out) - 1
            draft.saw(len(proposed), accepted)
            stats.proposed += len(proposed)
            stats.accepted += accepted
            stats.history.append((len(proposed), accepted))
        else:
            logits = model(mx.array([[last]], dtype=mx.int32), cache=kv)
            out = [int(mx.argmax(logits[0, -1]).item())]
        stats.forwards += 1
        stats.tokens += len(out)
        index.extend(out)
        last = out[-1]
        for token in out:
            produced += 1
            yield token, None
