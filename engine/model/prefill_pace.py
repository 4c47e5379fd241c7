"""Prefill step sizes from the measured speed (pure).

Every prefill step is one heartbeat of the worker's stuck detection, and a
step is one MLX call that nothing can interrupt: a step longer than
`[engine] stuck_grace_s` makes a slow machine's long prompt look like a hung
GPU (it did on 2 Linux cores: docs/BENCHMARKS.md, "Why the engine is built as
it is"). So the step follows the speed: a small first step measures it, and
each next step is what fits a fraction of the grace at the last speed seen
(the speed falls as the context grows: attention), never more than
`[engine] prefill_step_size`, and growing at most 4x a step.
"""

from __future__ import annotations

MULTIPLE = 16  # step sizes in multiples of this (shapes MLX has seen before)
# The most prompt tokens a step, unless configured ([engine] prefill_step_size). Beside decoding requests a
# step's chunk holds their next token for its forward: 512 keeps that short on a Mac's GPU. On MLX's CUDA
# backend every chunk is a new attention shape (its keys' length), for which cuDNN builds a graph, 70-150 ms
# with every row waiting (docs/BENCHMARKS.md): there a joining turn in one step of up to 2048 tokens (mlx-lm's
# own default) builds one graph, not four.
DEFAULT_STEP_SIZE = 512
DEFAULT_STEP_SIZE_CUDA = 2048


# On MLX's CUDA backend a joining prompt's chunk is widened to whole steps of this many positions (aligned_chunk).
ALIGN = 256


def aligned_chunk(offset: int, n: int, buffer_len: int, align: int = ALIGN) -> tuple[int, int]:
    """Where a step runs a prompt chunk of `n` tokens that follows `offset`
    cached ones: (start, end) positions (pure). Widened to whole `align`s --
    started at the whole step at or below `offset` (those cached tokens
    computed again: the same KV) and ended at the one at or above its end
    (padding, whose KV lands past the row's tokens and is left out of its
    offset) -- where the row's KV buffer of `buffer_len` positions holds
    the end; else as it is. On MLX's CUDA backend every attention shape a
    chunk meets (its queries' and keys' lengths) costs a cuDNN graph, built
    while every row waits (70-150 ms); widened, agents of like lengths meet
    the same shapes and the graph built for one serves the others."""
    start, end = offset - offset % align, -(-(offset + n) // align) * align
    if n <= 0 or end > buffer_len:
        return offset, offset + n
    return start, end


def default_step_size(configured: int | None, on_cuda: bool) -> int:
    """The most prompt tokens a prefill step (pure): as configured, else by backend."""
    if configured is not None:
        return configured
    return DEFAULT_STEP_SIZE_CUDA if on_cuda else DEFAULT_STEP_SIZE


class PrefillPace:
    """Owned by the worker thread; one per loaded model."""

    def __init__(self, ceiling: int, step_budget_s: float, first: int = 32, floor: int = MULTIPLE) -> None:
        self.ceiling = ceiling
        self.step_budget_s = step_budget_s
        self.first = min(first, ceiling)
        self.floor = min(floor, ceiling)
        self.tokens_per_s: float | None = None  # the last step's speed
        self._last_step = self.first

    def step(self) -> int:
        """Tokens to prefill in the next step."""
        if self.tokens_per_s is None:
            return self.first
        fits = int(self.tokens_per_s * self.step_budget_s) // MULTIPLE * MULTIPLE
        return max(self.floor, min(self.ceiling, fits, self._last_step * 4))

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        self.tokens_per_s = tokens / seconds
        # Growth starts from the largest step taken: a prompt's short last
        # step (its remainder) says nothing about the size that fits, and on
        # a GPU starting the next prompt again from 4x it cost steps (and new
        # shapes) at every request.
        self._last_step = max(self._last_step, tokens, self.floor)
