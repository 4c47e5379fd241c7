"""Running a prompt through the model into its KV, outside mlx-lm's
generate loop: `prefill` a step at a time as the engine's pace sizes them
(engine/model/prefill_pace.py; each step a heartbeat within the stuck grace), and
`recompute`, approximate reuse's changed spans over cached KV
(engine/cache/reuse.py).

The batch uses them (engine/model/batch_decoder.py; recompute
through engine/model/runner.py), on the worker thread only. MLX is
imported inside the functions, after the engine has chosen its BLAS
(engine/cpu/fast_blas.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from mlxd.memory_estimate import KVLayout

from .errors import EngineError
from .faults import FaultInjector
from .prefill_pace import PrefillPace


def cancelled_error() -> EngineError:
    """A cancelled request's end, in its prefill or its decode: the client
    went away (nobody reads it) or the drain's grace ran out (the client
    retries elsewhere). Never an answer ended as if it were complete."""
    return EngineError(503, "generation cancelled: the engine is shutting down", code="engine_unavailable",
                       retry_after=5)


def prefill(model: Any, prompt_cache: list[Any], tokens: list[int], pace: PrefillPace, progress: Callable[[], None],
            faults: FaultInjector | None = None, kv: KVLayout = KVLayout(),
            cancelled: threading.Event | None = None) -> None:
    """Run `tokens` through the model into `prompt_cache`, as mlx-lm's
    generate_step does, a step at a time as `pace` sizes them (each step a
    heartbeat well within the stuck grace, however slow the machine), its
    layers quantised once they reach `kv.quantized_start` positions.
    Raises cancelled_error() between steps once `cancelled` is set: a client
    that hangs up during a long prompt frees the engine within one step (the
    KV of the part done is dropped: the prompt cache keeps nothing partial)."""
    from ..cache.kv_cache import prefill_views, quantize_from

    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    ids = mx.array(tokens, dtype=mx.int32)
    start = 0
    with mx.stream(generation_stream):
        while start < len(tokens):
            if cancelled is not None and cancelled.is_set():
                raise cancelled_error()
            n = min(pace.step(), len(tokens) - start)
            began = time.perf_counter()
            model(ids[start:start + n][None], cache=prefill_views(prompt_cache))
            quantize_from(prompt_cache, kv)
            mx.eval([c.state for c in prompt_cache])
            if faults is not None and (delay := faults.prefill_delay_s(n)):
                time.sleep(delay)  # slow@prefill: a slow machine, for the tests
            pace.observe(n, time.perf_counter() - began)
            start += n
            progress()
            mx.clear_cache()


def recompute(model: Any, prompt_cache: list[Any], tokens: list[int], spans: tuple[tuple[int, int], ...], end: int,
              pace: PrefillPace, progress: Callable[[], None], cancelled: threading.Event | None = None) -> None:
    """Approximate reuse (engine/cache/reuse.py): recompute the KV of `tokens`'
    changed spans over the cached KV before each, in place, and leave the
    cache at `end`. Every layer is a plain KVCache (reuse.py's `patchable`)
    whose buffer already reaches `end`: setting its offset back makes the
    model write the span's new keys and values over the old ones, and the
    rest of the buffer stays as it was."""
    for start, stop in spans:
        for c in prompt_cache:
            c.offset = start
        prefill(model, prompt_cache, tokens[start:stop], pace, progress, cancelled=cancelled)
    for c in prompt_cache:
        c.offset = end

