"""Which model is resident, and MLX's memory with it, for the core
(engine/core/engine_core.py): one owner, `Residency`, of the model's load and
unload (one model at a time: engine/model/model_cache.py decides), its
preload, and MLX's memory limit and figures (the core publishes them).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..model.errors import EngineError
from ..model.model_cache import Unload, plan_release, plan_switch
from .device_memory import DeviceMemoryWatch, over_budget
from .memory_ledger import ModelFigures
from .worker_state import Phase

log = logging.getLogger("mlxd.engine.core.worker")


class Residency:
    def __init__(self, core: Any) -> None:
        self.core = core  # whose runner, ledger, prompt cache and published figures these change
        self.trimmed_at = 0.0  # when MLX's cache was last given back for a process over its budget (monotonic)

    def preload(self, default_model: str | None) -> None:
        """The default model loaded at boot (a refused one is logged and skipped)."""
        core = self.core
        self.sample_memory()
        core.active_before_first_load = core.memory.active_bytes
        if default_model:
            try:
                core.registry.check_allowed(default_model)
            except EngineError as refusal:
                log.warning("not preloading %s: %s", default_model, refusal.message)
            else:
                self.ensure(default_model)  # an error here is fatal: exit_codes.PRELOAD_FAILED
                core.idle_unload.served()
        core.publish(Phase.IDLE)

    def ensure(self, model_id: str) -> None:
        """`model_id` resident: the other unloaded first."""
        core = self.core
        for change in plan_switch(core.runner.resident_id, model_id):
            if isinstance(change, Unload):
                self.unload()
            else:
                core.publish(Phase.LOADING)
                self.load(change.model_id)

    def unload(self) -> None:
        core = self.core
        started = time.monotonic()
        # Entries never cross models: to disk, out of memory -- before the runner's unload, whose clear of MLX's
        # buffer cache then takes their buffers too.
        core.prompt_cache.set_model(None, 0)
        core.runner.unload()
        core.ledger.set_model(None)
        core.counters["model_unloads"] += 1
        self.sample_memory()
        core.timings["last_unload_s"] = round(time.monotonic() - started, 4)
        core.active_after_last_unload = core.memory.active_bytes
        # Peak memory from here on covers the next model alone: with it a
        # test (and an operator) can see that two models never coexisted.
        core.runner.reset_peak()

    def load(self, model_id: str) -> None:
        core = self.core
        core.registry.check_allowed(model_id)  # re-checked: files may have changed
        core.faults.check("load")
        started = time.monotonic()
        try:
            plan = core.runner.load(model_id)
        except EngineError:
            for _ in plan_release(core.runner.resident_id):
                self.unload()
            raise
        info = core.registry.info(model_id)
        core.ledger.set_model(ModelFigures(info.footprint.weights_bytes, info.config or {}, plan.kv))
        if plan.prompt_cache:
            core.prompt_cache.set_model(core.registry.build_key(model_id, core.registry.load_target(model_id)),
                                        info.prompt_cache_bytes, core.runner.generation_prompt_length(),
                                        plan.kv.coarse_steps)
        else:  # mlx-vlm's generation, a rank group: no prompt cache of ours
            core.prompt_cache.set_model(None, 0)
        core.counters["model_loads"] += 1
        core.idle_unload.loaded()
        self.sample_memory()
        core.timings["last_load_s"] = round(time.monotonic() - started, 4)
        log.info("loaded %s in %.1fs (MLX active %.0f MiB%s; %s)", model_id, time.monotonic() - started,
                 core.memory.active_bytes / 2**20, ", as float32: the CPU's fast path" if plan.cpu_float32 else "",
                 f"up to {plan.max_concurrency} requests at once" if plan.max_concurrency > 1 else "one request at a time")

    def bound_mlx_memory(self) -> None:
        """MLX's buffer cache within the budget: MLX frees cached buffers before
        its active plus cached memory would pass this limit (Metal's and CUDA's
        allocators check it at every allocation). Left at MLX's default (95 %
        of a CUDA card, 1.5x Metal's recommended working set) the cache grew
        the process past the budget unseen. Where nvidia-smi sees the process,
        what it holds outside MLX is measured and the limit leaves room for it."""
        core = self.core
        core.runner.set_memory_limit(core.ledger.limit_bytes)
        core.mlx_memory_limit = core.ledger.limit_bytes
        core.device_memory = DeviceMemoryWatch(os.getpid(), core.runner.mlx_bytes)
        core.device_memory.start()

    def sample_memory(self) -> None:
        """MLX's memory figures, for the core to publish; MLX's limit lowered where the process holds more outside it."""
        core = self.core
        core.memory = core.runner.memory()
        latest = core.device_memory.latest if core.device_memory is not None else None
        if latest is not None:
            limit = core.ledger.lower_limit(latest.outside_bytes)
            if limit is not None:
                core.runner.set_memory_limit(limit)
                core.mlx_memory_limit = limit
            if over_budget(latest, core.ledger.budget_bytes, self.trimmed_at):
                self.trimmed_at = time.monotonic()
                log.info("device memory: the process held %.2f GiB, over its %.2f GiB budget: MLX's buffer cache "
                         "given back", latest.process_bytes / 2**30, core.ledger.budget_bytes / 2**30)
                core.runner.clear_cache()
