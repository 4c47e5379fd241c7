"""How long the resident model stays loaded with nothing to do, and its
unload then: one owner, `IdleUnload`.

mlxd runs all day on a laptop whose memory its user also needs: after
`[engine] keep_alive` without a request the model, its KV and MLX's buffer
cache are given back (the engine core's `idle` asks `due`), and the next
request loads it again; the prompt cache's disk tier keeps the conversations
warm across. A request may set it for after itself, as Ollama's API has it:
`keep_alive` 0 unloads once it is answered, a negative one never. Durations
are written as Ollama (Go) writes them: "5m", "1h30m", "90s", "500ms", or a
number of seconds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mlxd.durations import NEVER, describe

from .worker_state import Phase

log = logging.getLogger("mlxd.engine.core.worker")


def unload_deadline(ended_at: float, keep_alive_s: float) -> float:
    """When a model left idle at `ended_at` is given back (NEVER, infinite, stays NEVER)."""
    return ended_at + keep_alive_s


def unload_due(now: float, deadline: float, resident: bool, busy: bool) -> bool:
    """Whether to unload now: a model resident, nothing running or waiting, its deadline passed."""
    return resident and not busy and now >= deadline


class IdleUnload:
    def __init__(self, keep_alive_s: float = NEVER) -> None:
        self.keep_alive_s = keep_alive_s
        self.unload_at = NEVER  # monotonic; every request's end moves it
        self.unloaded_at: float | None = None  # wall clock of the last idle unload, while none is resident
        self.unloaded_model: str | None = None  # which model that was

    def served(self, keep_alive_s: float | None = None) -> None:
        """A request ended (or a model was preloaded): the idle time starts
        again, the request's own keep_alive or (None) the engine's."""
        self.unload_at = unload_deadline(time.monotonic(), self.keep_alive_s if keep_alive_s is None else keep_alive_s)

    def due(self, resident: bool, busy: bool) -> bool:
        return unload_due(time.monotonic(), self.unload_at, resident, busy)

    def loaded(self) -> None:
        """A model was loaded: none given back is idle any more."""
        self.unloaded_at = self.unloaded_model = None

    def health(self, resident: bool) -> tuple[float, float | None, float | None, str | None]:
        """(keep_alive seconds (inf: never), seconds until the idle unload (None: none due), wall clock of the
        last idle unload while no model is resident, the model it gave back) for /health."""
        left = self.unload_at - time.monotonic()
        due = None if left == float("inf") or not resident else round(max(0.0, left), 1)
        return self.keep_alive_s, due, self.unloaded_at, self.unloaded_model

    def unload(self, core: Any) -> None:
        """The resident model given back by the core (engine/core/engine_core.py)
        after keep_alive with nothing to do: its weights, its KV, MLX's buffer
        cache (the prompt cache's entries go to disk); the next request loads it again."""
        runner = core.runner
        model_id, before = runner.resident_id, core.memory.active_bytes + core.memory.cache_bytes
        if model_id is None and runner.encoder is not None:
            model_id = runner.encoder.model_id
        runner.unload_encoder()
        core.residency.unload()
        # The entries' writes to disk done (a request arriving stops the wait), their staged copies freed, and
        # the C heap trimmed again: what they held comes back to the system too.
        core.prompt_cache.finish_writes(lambda: not core.admission.has_waiting())
        runner.give_heap_back()
        core.residency.sample_memory()
        self.unload_at, self.unloaded_at, self.unloaded_model = NEVER, time.time(), model_id
        core.counters["idle_unloads"] += 1
        after = core.memory.active_bytes + core.memory.cache_bytes
        log.info("unloaded %s after %s without a request (keep_alive): MLX memory %.0f -> %.0f MiB", model_id,
                 describe(self.keep_alive_s), before / 2**20, after / 2**20)
        core.publish(Phase.IDLE)
