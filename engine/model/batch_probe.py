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

PROBE_CONTEXT = 256  # tokens each row holds: an agent's turn holds more, which favours the batch no less
PROBE_REPEATS = 15


def batch_speedup(model: Any, rows: int = 4, context: int = PROBE_CONTEXT,
                  repeats: int = PROBE_REPEATS) -> float:
    """How many times more tokens a second a step of `rows` rows decodes
    than one row's step alone (the median of `repeats` pairs of steps, after
    one of each to warm up), over rows each holding `context` tokens of its own cache (at
    the model's dtype: what the rows share or not is the same quantised)."""
    caches = [make_kv(model, context + 2, KVLayout()) for _ in range(rows)]
    with mx.stream(generation_stream):
        for i, kv in enumerate(caches):
            model(mx.array([[(7 * j + i) % 97 + 3 for j in range(context)]]), cache=kv)
            mx.eval([c.state for c in kv])

        def alone() -> None:
            mx.eval(model(mx.array([[5]]), cache=caches[0]))
            trim_prompt_cache(caches[0], 1)

        def together() -> None:
            mx.eval(model(mx.array([[5]] * rows), cache=row_caches(caches, positions(caches))))
            for kv in caches:
                trim_prompt_cache(kv, 1)

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
