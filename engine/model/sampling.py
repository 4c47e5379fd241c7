"""A request's sampler and logits processors, from its sampling parameters
(mlx-lm's make_sampler / make_logits_processors), with the guards a request
needs so that it can never take the engine down; and a processor that also
sees the cached prefix, so that penalties look back the same way with and
without the prompt cache. MLX is imported inside the functions (the worker
thread calls them)."""

from __future__ import annotations

from typing import Any, Callable

from .job import SamplingParams
from ..cache.prompt_cache_policy import PROCESSOR_CONTEXT


def make_sampling(p: SamplingParams, vocab: int) -> tuple[Any, Any]:
    """(sampler, logits processors) for a request's parameters."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    # top_k at or over the vocabulary means "no top-k": MLX's partition
    # would fail on it, and a request must never take the engine down.
    top_k = p.top_k if 0 < p.top_k < vocab else 0
    sampler = make_sampler(temp=p.temperature, top_p=p.top_p if p.top_p < 1.0 else 0.0, min_p=p.min_p,
                           top_k=top_k)
    processors = make_logits_processors(p.logit_bias, p.repetition_penalty, presence_penalty=p.presence_penalty,
                                        frequency_penalty=p.frequency_penalty)
    return sampler, processors


def seeing_context(processor: Callable, context: list[int]) -> Callable:
    """A logits processor that also sees the tail of the cached prefix:
    mlx-lm hands processors only the tokens it prefilled itself, and
    penalties must look back the same way with and without the cache."""
    import mlx.core as mx

    head = mx.array(context[-PROCESSOR_CONTEXT:], dtype=mx.int32)

    def seeing(tokens: Any, logits: Any) -> Any:
        return processor(mx.concatenate([head.astype(tokens.dtype), tokens]), logits)

    return seeing
