"""Speculative decoding by prompt lookup (exact): its pure parts.

An agent's answer re-emits long spans of its context: an edit rewrites a file
the prompt holds, a tool call's arguments repeat paths and code. Prompt lookup
(llama.cpp's n-gram speculation; transformers' `prompt_lookup_num_tokens`)
proposes the tokens that followed the last few tokens' latest earlier
occurrence in the prompt and the answer so far, and the model verifies them
in one forward (engine/model/row_batch.py's verify step): the longest
prefix it would have chosen itself is kept, then its own next token. Greedy
answers are the same tokens, one to k + 1 of them per forward; sampled ones
are drawn from the same distribution (`accept_sampled`).

The decisions are pure: `NgramIndex` (where the suffix occurred before),
`DraftPolicy` (how many tokens to propose, by the acceptance and the cost of
a verify it has measured: none where no draft beats a plain step, so text
with nothing to copy, or a machine where a verify costs several steps, pays
almost nothing). A row's proposer (engine/model/row_proposals.py) drives
them in the batch's step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

NGRAM_MAX = 3  # the longest suffix looked up; longer matches are rarer and barely more precise
NGRAM_MIN = 2
DRAFT_MAX = 8  # tokens proposed at most per forward
VERIFY_SLOPE = 0.1  # what each proposed token adds to a verify, in plain steps (memory-bound: little)
GAIN_MARGIN = 0.05  # a draft must promise this much more than a plain step's tokens a second
DECAY = 0.8  # each token's weight against the ones before it (acceptance): the last ~5 count
EMA = 0.25  # each measurement's weight (times)


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
class DraftPolicy:
    """How many tokens to propose next (pure state; the caller reports what
    it saw and how long it took). It proposes the k that gives the most
    tokens a second, by what it has measured:
      - q, the chance that a proposed token is accepted given the one before
        it was, counted token by token with the latest counting most (an
        agent's answer copies in runs: a file's span, then a changed line),
        so a verify of k is expected to give 1 + q + q^2 + ... + q^k tokens.
        Every token counts, proposed or not: where it decodes plain steps it
        still compares each token with what the index would have proposed
        (`saw_shadow`), so it learns where copying starts without paying for
        a verify to find out;
      - a verify's cost in plain steps, 1 + overhead + VERIFY_SLOPE * k: on a
        GPU or Apple silicon a few tokens more per forward cost about nothing
        (memory-bound), on a CPU a many-token forward takes another path;
    and proposes nothing where no k beats a plain step by GAIN_MARGIN."""

    hits: float = 1.0  # discounted accepted (or would-be accepted) tokens (the prior: q = 1/2)
    misses: float = 1.0  # discounted rejections
    overhead: float = 0.0  # a verify's cost beyond 1 + VERIFY_SLOPE * k plain steps, measured
    step_s: float | None = None  # a plain step's time, measured

    @property
    def q(self) -> float:
        return self.hits / (self.hits + self.misses)

    def cost(self, k: int) -> float:
        return 1.0 + self.overhead + VERIFY_SLOPE * k

    def expected_tokens(self, k: int) -> float:
        q = self.q
        return 1.0 + sum(q ** i for i in range(1, k + 1))

    def best(self, available: int) -> tuple[int, float]:
        """(k, tokens per plain step's time) of the best draft length up to `available`."""
        return max(((k, self.expected_tokens(k) / self.cost(k)) for k in range(1, min(DRAFT_MAX, available) + 1)),
                   key=lambda kv: kv[1], default=(0, 0.0))

    def pays_for_certain(self, k: int) -> bool:
        """Whether a verify of `k` tokens sure to be accepted (forced by a grammar) beats plain steps."""
        return (k + 1) / self.cost(k) > 1.0 + GAIN_MARGIN

    def next_k(self, available: int) -> int:
        """Tokens to propose now, of the `available` the index has (0: a plain step)."""
        if available <= 0:
            return 0
        k, gain = self.best(available)
        return k if gain > 1.0 + GAIN_MARGIN else 0

    def _count(self, accepted: int, rejected: bool) -> None:
        for _ in range(accepted):
            self.hits, self.misses = DECAY * self.hits + 1.0, DECAY * self.misses
        if rejected:
            self.hits, self.misses = DECAY * self.hits, DECAY * self.misses + 1.0

    def saw_step(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else (1 - EMA) * self.step_s + EMA * seconds

    def saw_shadow(self, matched: bool) -> None:
        """A plain step's token against the first token the index had at hand for it."""
        self._count(1 if matched else 0, not matched)

    def saw_verify(self, proposed: int, accepted: int, seconds: float) -> None:
        self._count(accepted, accepted < proposed)
        if self.step_s:
            measured = max(0.0, seconds / self.step_s - 1.0 - VERIFY_SLOPE * proposed)
            self.overhead = (1 - EMA) * self.overhead + EMA * measured


@dataclass
class SpecStats:
    """What speculation did for one request: for the log and /metrics."""

    mode: str = "prompt_lookup"  # or "draft" (engine/model/draft_model.py)
    forwards: int = 0  # forward passes of the decode (verifies and plain steps)
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens the forwards produced

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0


@dataclass(frozen=True)
class SampledTarget:
    """A sampled request's distribution, as mlx-lm's make_sampler draws from
    it (engine/model/sampling.py's settings): temperature, then top-p, min-p,
    top-k on the log-probabilities, in make_sampler's order."""

    temperature: float
    top_p: float = 0.0  # 0: off, as make_sampler takes it
    min_p: float = 0.0
    top_k: int = 0

    @classmethod
    def of(cls, params: Any, vocab_size: int) -> "SampledTarget | None":
        """A request's distribution (its SamplingParams); None for a greedy one."""
        if params.temperature == 0:
            return None
        return cls(params.temperature, params.top_p if params.top_p < 1.0 else 0.0, params.min_p,
                   params.top_k if 0 < params.top_k < vocab_size else 0)

    def probs(self, logits: Any) -> Any:
        """Each position's distribution (positions x vocabulary)."""
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, 1)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs / self.temperature, axis=-1)


def accept_sampled(probs: Any, proposed: list[int]) -> list[int]:
    """The speculative acceptance rule for a draft that proposes one token for
    sure (prompt lookup): proposed token i is kept with the target's
    probability of it; at the first rejection a token is drawn from the target
    with the rejected token taken out (the residual max(0, p - q), q one-hot),
    or after a whole accepted draft from the next position's target. Each
    token comes out distributed exactly as the target's own draw
    (Leviathan et al., 2023). `probs`: (len(proposed) + 1) x vocabulary."""
    import mlx.core as mx

    out: list[int] = []
    for i, token in enumerate(proposed):
        p = probs[i]
        if mx.random.uniform().item() < p[token].item():
            out.append(token)
            continue
        residual = p * (mx.arange(p.shape[-1]) != token)
        out.append(int(mx.random.categorical(mx.log(residual)).item()))
        return out
    out.append(int(mx.random.categorical(mx.log(probs[len(proposed)])).item()))
    return out


def apply_masks(logits: Any, masks: Sequence[Any] | None) -> Any:
    """Each row of logits (positions x width) with the tokens its grammar
    mask (a bool per vocabulary entry, engine/model/constrained.py) does not
    allow at -inf, as the grammar's logits processor does; None: as they are."""
    if not masks:
        return logits
    import mlx.core as mx
    import numpy as np

    width = logits.shape[-1]
    allowed = np.stack([np.pad(m, (0, max(width - m.shape[0], 0)))[:width] for m in masks])
    return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))
