"""What the decoder holds and hands back (engine/model/batch_decoder.py,
engine/model/vision_row.py), shared with the runner and the core: a request
admitted into a decoder (`Admitted`), one that left it with its KV (`Ended`), a
row's sampler and logits processors (`RowSampling`). The decoder itself is
engine/model/decoding.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..cache.prompt_cache_policy import Fetched
from .generation import Generation
from .job import Job

CHECKPOINT_TOKENS = 2048  # a long prompt's KV reaches disk every this many prefilled tokens


@dataclass(eq=False)
class Admitted:
    """A request in a decoder."""

    job: Job
    generation: Generation
    prompt: list[int]
    fetched: Fetched
    detokenizer: Any
    needs_snapshot: bool  # its KV cannot be cut back: kept at the prompt's boundary for the prompt cache
    alone: bool = False  # decoded alone and nobody joins it (a seed, an image, a rank group, max_concurrency 1)
    taken_at: float = field(default_factory=time.monotonic)  # from the queue
    admitted_at: float = field(default_factory=time.monotonic)
    joined_at: float | None = None  # decoding (its cached prefix fetched and its prompt prefilled, or joining)
    snapshot: list[Any] | None = None
    first_token_at: float | None = None
    # Its KV and the prompt tokens it covers, once prefilled: the core writes them to disk after its
    # first token (engine/cache/prompt_cache.py, checkpoint), then lets go.
    prefilled: tuple[list[Any], int] | None = None
    checkpoint: Any = None  # the prompt cache's write of its prompt, awaited before its answer's end
    # Where a long prefill leaves its KV so far, every CHECKPOINT_TOKENS (the core's; None: nowhere):
    # save_progress(this request, kv, tokens covered). A crash mid-prefill then costs at most that many tokens.
    # (The core's hook itself, not a closure over this request: that would be a reference cycle, and the
    # request's KV would outlive it until Python's cyclic collector ran -- a turn's whole KV a request.)
    save_progress: Callable[["Admitted", list[Any], int], None] | None = None

    def feed(self, token: int | None, text: str | None, model_finish: str | None) -> str | None:
        """A token to its request: detokenized (as mlx_lm.server does; mlx-vlm's
        stream brings its text) and relayed. The finish, or None to go on."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if text is None:
            detok = self.detokenizer
            if model_finish != "stop":
                detok.add_token(token)
            if model_finish is not None:
                detok.finalize()
            text = detok.last_segment
        return self.generation.feed(text, token, model_finish)


@dataclass(frozen=True)
class Ended:
    """A request that left its decoder, with its KV for the prompt cache."""

    admitted: Admitted
    finish: str
    kv: list[Any] | None  # the KV of its prompt and what it generated (all but the last token)
    speculation: Any = None  # SpecStats (engine/model/speculative.py) of a request decoded speculatively


@dataclass(frozen=True)
class RowSampling:
    """A row's sampler (None: greedy) and logits processors, the grammar's last."""

    sampler: Any
    processors: list[Any]
