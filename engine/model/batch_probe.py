"""Whether a batch pays on this model and backend, measured at its load.

A batched decode step pays where the rows share what a step costs most:
reading the weights. A large model on a GPU reads them once for every row
(the lent H100: four rows of the 8B model a step in 19.7 ms, one alone in
~7.5 ms); a small model on the CPU, whose weights sit in the cache, spends
a step on each row's own products and attention, so four rows cost what
four steps alone do, or more (the demo model on 2 cores: 10.8 ms against
2.3 ms) -- and serving its agents one at a time gives more tokens a second
(docs/BENCHMARKS.md). `batch_speedup` times both on the loaded model; the
serving plan (engine/model/serving_plan.py) decides.

Where rows speculate (prompt lookup, a draft), a step is often a verify of a
few tokens a row, where a compute-bound backend pays for every row's tokens:
the runner times that shape too (`width` = VERIFY_WIDTH) and takes the
lesser. On the CPU nothing is probed: a probe of the forward alone said
1.2-2.6x there while four agents batched served 0.82-0.94x the turns a minute
of the same agents one at a time (the serving plan's ON_CPU).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import trim_prompt_cache

from mlxd.memory_estimate import KVLayout

from ..cache.kv_cache import make_kv
from .row_attention import positions, row_caches

PROBE_CONTEXT = 256  # tokens each row holds (an agent's turn holds more: each row's attention costs more, shared less)
PROBE_REPEATS = 15
VERIFY_WIDTH = 5  # a verify step's tokens a row: the last token and the few proposals a draft policy mostly keeps


def batch_speedup(model: Any, rows: int = 4, context: int = PROBE_CONTEXT,
                  repeats: int = PROBE_REPEATS, width: int = 1) -> float:
    """How many times more tokens a second a step of `rows` rows decodes
    than one row's step alone (the median of `repeats` pairs of steps, after
    one of each to warm up), over rows each holding `context` tokens of its own cache (at
    the model's dtype: what the rows share or not is the same quantised);
    `width` tokens a row a step (a verify's shape above 1)."""
    caches = [make_kv(model, context + width + 1, KVLayout()) for _ in range(rows)]
    step = [5] * width
    with mx.stream(generation_stream):
        for i, kv in enumerate(caches):
            model(mx.array([[(7 * j + i) % 97 + 3 for j in range(context)]]), cache=kv)
            mx.eval([c.state for c in kv])

        def alone() -> None:
            mx.eval(model(mx.array([step]), cache=caches[0]))
            trim_prompt_cache(caches[0], width)

        def together() -> None:
            mx.eval(model(mx.array([step] * rows), cache=row_caches(caches, positions(caches))))
            for kv in caches:
                trim_prompt_cache(kv, width)

        alone(), together()  # shapes seen once: the first of each is not timed
        ratios = []
        for _ in range(repeats):  # in pairs, so that the machine's drift (other work on it) falls on both
            one, many = _seconds(alone), _seconds(together)
            ratios.append(rows * one / max(many, 1e-9))
    return statistics.median(ratios)


def _seconds(step: Any) -> float:
    began = time.perf_counter()
    step()
    return time.perf_counter() - began
