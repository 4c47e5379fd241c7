"""The model worker: the one thread that owns the model and every MLX call.

It is the loop around the engine's core (engine/core/engine_core.py): boot (the
prompt cache's index, MLX's memory limit, the default model), then
`core.step()` until it is stopped or an MLX fault ends it. The core owns the
request table, the memory ledger, the prompt cache and the runner
(engine/model/runner.py: the resident model and its decoders). HTTP handlers never
touch MLX; they read what the core publishes (`status`, `memory`:
worker_state.py), through the views below.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import mlxd
from mlxd.durations import parse_duration
from mlxd.memory_estimate import KVLayout
from mlxd.reports import PromptCacheReport

from .admission import AdmissionQueue
from .device_memory import DeviceMemoryWatch
from .embedding_queue import EmbeddingQueue
from .engine_core import EngineCore
from ..model.faults import FaultInjector
from ..model.job import Job
from ..model.model_registry import ModelRegistry
from ..cache.prompt_cache import PromptCache
from ..model.runner import ModelRunner
from ..model.serving_plan import ServingPlan
from ..model.mlx_memory import MemorySnapshot
from .worker_state import Phase, WorkerStatus


class ModelWorker(threading.Thread):
    def __init__(
        self,
        registry: ModelRegistry,
        admission: AdmissionQueue[Job],
        faults: FaultInjector,
        on_fatal: Callable[[BaseException, Job | None], None],
        max_prompt_tokens: int,
        default_model: str | None,
        inflight_path: Path | None = None,
        prefill_step_size: int = 512,
        make_prompt_cache: Callable[[], PromptCache] | None = None,
        link: Any = None,
        stuck_grace_s: float = 30.0,
        embeddings: EmbeddingQueue | None = None,
    ) -> None:
        super().__init__(name="mlxd-model-worker", daemon=True)
        self.default_model = default_model
        self.link = link
        self._stop_event = threading.Event()
        # Built on this thread when it starts (it reads the disk tier's index).
        self._make_prompt_cache = make_prompt_cache or (lambda: PromptCache(False, None, 0.0))
        # A prefill step's share of the stuck grace: the pace sizes steps to a sixth of it.
        runner = ModelRunner(registry, faults, max_prompt_tokens, prefill_step_size, stuck_grace_s / 6,
                             heartbeat=lambda *_: self.core.heartbeat(), link=link)
        self.core = EngineCore(registry, admission, faults, runner, on_fatal, inflight_path, prefill_step_size,
                               parse_duration(registry.config.engine.keep_alive), embeddings)
        self.ready = threading.Event()  # preload finished (or was skipped)
        self.ready_at: float | None = None  # wall clock, when ready was set

    # --- the loop ----------------------------------------------------------------
    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        core = self.core
        try:
            # Where a (re)start's time goes, for /health's timings (bench/recovery.py splits the load by them):
            # the process to here (interpreter, imports, the app), mlx-lm's import, the prompt cache's disk
            # index, the weights.
            core.timings["start_to_worker_s"] = round(time.time() - mlxd.STARTED_AT, 4)
            core.inflight.discard()  # the listener has read it by now
            core.faults.refresh()
            core.faults.check("boot")
            began = time.monotonic()
            import mlx_lm  # noqa: F401 - timed apart: with transformers, most of a restart's time before the weights

            core.timings["mlx_lm_import_s"] = round(time.monotonic() - began, 4)
            began = time.monotonic()
            core.use_prompt_cache(self._make_prompt_cache())
            core.timings["prompt_cache_index_s"] = round(time.monotonic() - began, 4)
            core.residency.bound_mlx_memory()
            core.residency.preload(self.default_model)
            self.ready_at = time.time()
            self.ready.set()
            while not self._stop_event.is_set() and not core.stopped:
                core.step()
            if core.stopped:  # an MLX fault: the engine exits (Lifecycle)
                return
            if self.link is not None:
                from ..model.ranks import STOP

                self.link.share((STOP,))  # the other ranks exit 0 with us
            core.prompt_cache.idle()  # a clean stop keeps the conversation in progress on disk
            core.prompt_cache.flush()  # and every file the writer had under way
            core.held.send_all()  # then the answers' ends held for their prompt on disk (held_answers.py)
            core.inflight.flush()  # and the in-flight record as it stands
        except BaseException as exc:  # noqa: BLE001 - anything escaping is fatal
            core.publish(Phase.FAILED)
            self.ready.set()
            try:  # answers already whole, held for their prompt on disk, go out before the engine does
                core.held.send_all()
            except BaseException:  # noqa: BLE001 - the fault that stopped the core is the one to report
                pass
            core.on_fatal(exc, None)
            return
        core.publish(Phase.STOPPED)

    # --- views for other threads (what the core published) ------------------------
    @property
    def status(self) -> WorkerStatus:
        return self.core.status

    @property
    def memory(self) -> MemorySnapshot:
        return self.core.memory

    @property
    def counters(self) -> dict[str, int]:
        return self.core.counters

    @property
    def timings(self) -> dict[str, float]:
        return self.core.timings

    @property
    def max_observed_concurrency(self) -> int:
        return self.core.max_observed_concurrency

    @property
    def mlx_memory_limit(self) -> int | None:
        return self.core.mlx_memory_limit

    @property
    def device_memory(self) -> DeviceMemoryWatch | None:
        return self.core.device_memory

    @property
    def active_before_first_load(self) -> int | None:
        return self.core.active_before_first_load

    @property
    def active_after_last_unload(self) -> int | None:
        return self.core.active_after_last_unload

    @property
    def idle_unload(self) -> tuple[float, float | None, float | None, str | None]:
        """(keep_alive seconds (inf: never), seconds until the idle unload (None: none due), wall clock of the
        last idle unload while no model is resident, the model it gave back) for /health."""
        return self.core.idle_unload.health(self.core.runner.resident_id is not None)

    @property
    def plan(self) -> ServingPlan | None:
        """The resident model's serving plan (engine/model/serving_plan.py)."""
        return self.core.runner.plan

    @property
    def resident_kv(self) -> KVLayout | None:
        """The resident model's KV layout as served (for /health)."""
        plan = self.plan
        return plan.kv if plan is not None else None

    @property
    def resident_encoder(self) -> str | None:
        """The embedding model resident beside the chat model, if any (for /health)."""
        encoder = self.core.runner.encoder
        return encoder.model_id if encoder is not None else None

    @property
    def resident_reranker(self) -> str | None:
        """The cross-encoder reranker resident beside the chat model, if any (for /health)."""
        reranker = getattr(self.core.runner, "reranker", None)
        return reranker.model_id if reranker is not None else None

    @property
    def resident_tools(self) -> str | None:
        """Who renders the resident model's tools: "template" or "mlxd" (for /health)."""
        resident = self.core.runner.resident
        return resident.tools_by if resident is not None else None

    @property
    def active_generations(self) -> int:
        """Requests prefilling or decoding now."""
        return len(self.status.running)

    def running_jobs(self) -> list[Job]:
        """Every request held (the drain cancels them), from the published snapshot."""
        return [r.job for r in self.status.requests]

    def cache_stats(self) -> PromptCacheReport:
        return self.core.cache_stats()
