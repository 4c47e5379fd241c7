"""The model worker: the one thread that owns the model and every MLX call.

Its job loop takes jobs from the AdmissionQueue, makes the job's model
resident (unloading the previous one first) and serves it: alone
(lone_turns.py: every job with max_concurrency = 1) or in a batch
(batched_turns.py, as engine/scheduler.py decides). Each job's Generation
reports through the job's EventChannel. The worker owns the resident model
(loaded by model_load.py) and the prompt cache, and the cache's steps of a
turn (turn_kv.py: `_cached_start`, `_store_turn`) serve both ways. HTTP
handlers never touch MLX; they read the worker's published `status` and
`memory` snapshots (worker_state.py).

An exception out of MLX is fatal by design: the request gets a 500 and the
worker hands the exception to `on_fatal` (the engine's Lifecycle), which
exits with exit_codes.MLX_ERROR so the supervisor restarts the engine clean
rather than let it limp on.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from mlxd.memory_estimate import KVLayout, attention_heads, kv_cache_bytes
from mlxd.records import InflightRequest
from mlxd.reports import PromptCacheReport

from .admission import AdmissionQueue
from .batch import BatchRun, batchable_model
from .batched_turns import BatchedTurns, Prepared
from .lone_turns import LoneTurns
from .device_memory import DeviceMemoryWatch, mlx_limit
from .errors import EngineError
from .events import Failed
from .faults import FaultInjector
from .generation import ResidentModel
from .jobs import Job
from .model_cache import Unload, plan_release, plan_switch
from .model_load import load_resident, load_shard, with_kv_layout
from .model_registry import ModelRegistry
from .prompt_cache import PromptCache
from .prompt_tokens import generation_prompt_length
from .prefill_pace import PrefillPace
from .scheduler import Memory, attention_bytes_per_position
from .turn_kv import TurnKV
from .request_table import RequestStatus, RequestTable, running
from .worker_state import MemorySnapshot, Phase, WorkerStatus

log = logging.getLogger("mlxd.engine.worker")

HEARTBEAT_S = 0.05  # progress is published at most this often


class ModelWorker(LoneTurns, BatchedTurns, TurnKV, threading.Thread):
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
    ) -> None:
        super().__init__(name="mlxd-model-worker", daemon=True)
        self.prefill_step_size = prefill_step_size  # the most tokens a prefill step takes
        # A step's share of the stuck grace: the pace sizes steps to a sixth of it.
        self.prefill_step_budget_s = stuck_grace_s / 6
        self.pace = PrefillPace(prefill_step_size, self.prefill_step_budget_s)  # measured anew per model
        self.link = link  # rank 0 of a rank group (engine/ranks.py): loads and forward passes are mirrored
        self.registry = registry
        self.admission = admission
        self.faults = faults
        self.on_fatal = on_fatal
        self.max_prompt_tokens = max_prompt_tokens
        self.default_model = default_model
        # The request in flight, on disk: after a crash the listener reads
        # it to journal (and eventually quarantine) the request.
        self.inflight_path = inflight_path
        self._stop_event = threading.Event()
        # Owned by this thread; other threads read the published snapshots.
        self._resident: ResidentModel | None = None
        # Built on this thread when it starts (it reads the disk tier's index).
        self._make_prompt_cache = make_prompt_cache or (lambda: PromptCache(False, None, 0.0))
        self.prompt_cache: PromptCache | None = None
        self.table = RequestTable()  # every request held, one status each; published in `status`
        self._timeline: list[tuple[str, float]] = []  # moments of the request served alone (debug log)
        self._batch: BatchRun | None = None  # the requests generated together (max_concurrency > 1)
        self._pending: Prepared | None = None  # the next to join the batch, once memory allows
        self._batch_memory: Memory | None = None  # the resident model's figures for admission
        self._mergeable = False  # mlx-lm can batch the resident model
        self.status = WorkerStatus(Phase.STARTING, None)
        self.resident_kv: KVLayout | None = None  # the resident model's KV layout as served (for /health)
        self.resident_tools: str | None = None  # who renders its tools: "template" or "mlxd" (for /health)
        self.memory = MemorySnapshot()
        self.active_before_first_load: int | None = None
        self.active_after_last_unload: int | None = None
        self.mlx_memory_limit: int | None = None  # what MLX's allocator keeps active + cached memory under
        self.device_memory: DeviceMemoryWatch | None = None  # the process's device memory, from outside
        self.ready = threading.Event()  # preload finished (or was skipped)
        self.ready_at: float | None = None  # wall clock, when ready was set
        self.max_observed_concurrency = 0
        self.timings: dict[str, float] = {}  # last_load_s, last_unload_s: for benchmarks and status
        self.counters = {"model_loads": 0, "model_unloads": 0, "generated_tokens": 0, "prompt_tokens": 0,
                         "jobs": 0}

    # --- lifecycle -------------------------------------------------------
    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            if self.inflight_path is not None:
                self.inflight_path.unlink(missing_ok=True)  # the listener has read it by now
            self.faults.refresh()
            self.faults.check("boot")
            self.prompt_cache = self._make_prompt_cache()
            self._bound_mlx_memory()
            self._preload()
            self.ready_at = time.time()
            self.ready.set()
            while not self._stop_event.is_set():
                if self.admission.slots > 1:
                    self._batch_turn()
                    continue
                job = self.admission.take(timeout=0.25)
                if job is None:
                    self._idle_tick()
                    continue
                self._serve(job)
            if self.status.phase is Phase.FAILED:
                return
            if self.link is not None:
                from .ranks import STOP

                self.link.share((STOP,))  # the other ranks exit 0 with us
            self.prompt_cache.idle()  # a clean stop keeps the conversation in progress on disk
            self.prompt_cache.flush()  # and every file the writer had under way
        except BaseException as exc:  # noqa: BLE001 - anything escaping is fatal
            self._publish(Phase.FAILED)
            self.ready.set()
            self.on_fatal(exc, None)
            return
        self._publish(Phase.STOPPED)

    def _bound_mlx_memory(self) -> None:
        """MLX's buffer cache within the budget: MLX frees cached buffers before
        its active plus cached memory would pass this limit (Metal's and CUDA's
        allocators check it at every allocation). Left at MLX's default (95 %
        of a CUDA card, 1.5x Metal's recommended working set) the cache grew
        the process past the budget unseen (issue 35: 72.5 GB against 59.7 GiB).
        Where nvidia-smi sees the process, what it holds outside MLX is
        measured and the limit leaves room for it (`_rebound_mlx_memory`)."""
        import mlx.core as mx

        mx.set_memory_limit(self.registry.budget_bytes)
        self.mlx_memory_limit = self.registry.budget_bytes
        self.device_memory = DeviceMemoryWatch(os.getpid(), lambda: mx.get_active_memory() + mx.get_cache_memory())
        self.device_memory.start()

    def _rebound_mlx_memory(self) -> None:
        """MLX's limit (and the batch's admission) lowered by the memory the
        process holds outside MLX, as last measured (engine/device_memory.py)."""
        latest = self.device_memory.latest if self.device_memory is not None else None
        if latest is None:
            return
        limit = mlx_limit(self.registry.budget_bytes, latest.outside_bytes)
        if limit == self.mlx_memory_limit:
            return
        import mlx.core as mx

        mx.set_memory_limit(limit)
        self.mlx_memory_limit = limit
        if self._batch_memory is not None:
            self._batch_memory = replace(self._batch_memory, budget_bytes=limit)

    def _preload(self) -> None:
        self._sample_memory()
        self.active_before_first_load = self.memory.active_bytes
        if not self.default_model:
            self._publish(Phase.IDLE)
            return
        try:
            self.registry.check_allowed(self.default_model)
        except EngineError as refusal:
            log.warning("not preloading %s: %s", self.default_model, refusal.message)
            self._publish(Phase.IDLE)
            return
        self._ensure_model(self.default_model)  # an error here is fatal: exit_codes.PRELOAD_FAILED
        self._publish(Phase.IDLE)

    def _idle_tick(self) -> None:
        if self.faults.enabled:
            self.faults.refresh()
            self.faults.check("idle")
        self.prompt_cache.idle()
        if time.monotonic() - self.memory.taken_at > 1.0:
            self._sample_memory()

    # --- publishing ------------------------------------------------------
    def _publish(self, phase: Phase | None = None) -> None:
        """One snapshot for other threads: the phase and the request table's
        rows. `phase` None: from the requests held (decoding once any has its
        first token, prefilling while any runs, else idle)."""
        requests = self.table.rows()
        if phase is None:
            statuses = {r.status for r in requests}
            phase = (Phase.DECODE if RequestStatus.DECODING in statuses else
                     Phase.PREFILL if RequestStatus.PREFILLING in statuses else Phase.IDLE)
        s = self.status
        if s.phase is not phase or s.requests != requests or s.resident_model != self._resident_id:
            self.status = WorkerStatus(phase, self._resident_id, requests)
        self.max_observed_concurrency = max(self.max_observed_concurrency, len(self.status.running))

    def _let_go(self, job: Job, held_s: float) -> None:
        """A request the worker holds no more (answered, refused, or gone):
        out of the request table, published, its place in admission freed."""
        self.table.release(job)
        self._publish()
        self.admission.done(job, held_s)

    @property
    def active_generations(self) -> int:
        """Requests prefilling or decoding now (any thread: a view of `status`)."""
        return len(self.status.running)

    def running_jobs(self) -> list[Job]:
        """Every request the worker holds (any thread: the drain cancels them), from the published snapshot."""
        return [r.job for r in self.status.requests]

    def _heartbeat(self, *_: Any) -> None:
        s = self.status
        now = time.monotonic()
        if now - s.last_progress < HEARTBEAT_S:
            return
        self.status = replace(s, last_progress=now)

    def _sample_memory(self) -> None:
        import mlx.core as mx

        self.memory = MemorySnapshot(mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory(),
                                     time.monotonic())
        self._rebound_mlx_memory()

    def cache_stats(self) -> PromptCacheReport:
        """The prompt cache's latest published figures (any thread)."""
        cache = self.prompt_cache
        return cache.stats if cache is not None else PromptCacheReport()

    # --- the model cache -------------------------------------------------
    @property
    def _resident_id(self) -> str | None:
        return self._resident.model_id if self._resident is not None else None

    def _ensure_model(self, model_id: str) -> None:
        for step in plan_switch(self._resident_id, model_id):
            if isinstance(step, Unload):
                self._unload()
            else:
                self._publish(Phase.LOADING)
                self._load(step.model_id)

    def _unload(self) -> None:
        import mlx.core as mx

        started = time.monotonic()
        self._resident = None
        self.resident_kv = None
        self.resident_tools = None
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        if self.link is not None:
            from .ranks import UNLOAD

            self.link.share((UNLOAD,))
        self.prompt_cache.set_model(None, 0)  # entries never cross models: to disk, out of memory
        gc.collect()
        mx.clear_cache()
        self.counters["model_unloads"] += 1
        self._sample_memory()
        self.timings["last_unload_s"] = round(time.monotonic() - started, 4)
        self.active_after_last_unload = self.memory.active_bytes
        # Peak memory from here on covers the next model alone: with it a
        # test (and an operator) can see that two models never coexisted.
        mx.reset_peak_memory()

    def _load(self, model_id: str) -> None:
        self.registry.check_allowed(model_id)  # re-checked: files may have changed
        self.faults.check("load")
        target = self.registry.load_target(model_id)
        started = time.monotonic()
        log.info("loading model %s from %s", model_id, target)
        try:
            resident = (load_resident(model_id, target, self.registry.info(model_id).weights_dtype)
                        if self.link is None else load_shard(model_id, target, self.link))
        except (OSError, ValueError, KeyError, ImportError) as exc:
            # Missing files, unsupported architecture, no network for a
            # download: not an MLX fault; the engine stays up.
            for step in plan_release(self._resident_id):
                self._unload()
            raise EngineError(503, f"could not load model {model_id!r}: {exc}", code="model_load_failed",
                              param="model", retry_after=30) from exc
        info = self.registry.info(model_id)
        if not resident.vision and self.link is None:
            resident = with_kv_layout(resident, info.kv)
        self._resident = resident
        self.resident_kv = resident.kv
        self.resident_tools = resident.tools_by
        self.pace = PrefillPace(self.prefill_step_size, self.prefill_step_budget_s)
        self._mergeable = not resident.vision and self.link is None and batchable_model(resident.model)
        limit = self.mlx_memory_limit or self.registry.budget_bytes
        self._batch_memory = Memory(limit, info.footprint.weights_bytes,
                                    kv_cache_bytes(info.config, 1) if info.config else 0,
                                    attention_bytes_per_position(attention_heads(info.config),
                                                                 self.prefill_step_size))
        if resident.vision or self.link is not None:  # mlx-vlm's generation, a rank group: no prompt cache of ours
            self.prompt_cache.set_model(None, 0)
        else:
            self.prompt_cache.set_model(self.registry.build_key(model_id, target),
                                        self.registry.info(model_id).prompt_cache_bytes,
                                        generation_prompt_length(resident.tokenizer))
        self.counters["model_loads"] += 1
        self._sample_memory()
        self.timings["last_load_s"] = round(time.monotonic() - started, 4)
        log.info("loaded %s in %.1fs (MLX active %.0f MiB%s)", model_id, time.monotonic() - started,
                 self.memory.active_bytes / 2**20, ", as float32: the CPU's fast path" if info.weights_dtype else "")

    # --- serving one job ---------------------------------------------------
    def _record_inflight(self) -> None:
        """The requests running (prefilling or decoding), oldest first, on disk (none: the file goes)."""
        if self.inflight_path is None:
            return
        jobs = [r.job for r in running(self.table.rows())]
        try:
            if not jobs:
                self.inflight_path.unlink(missing_ok=True)
            else:
                m, job = self.memory, jobs[0]
                InflightRequest(request_id=job.id, fingerprint=job.fingerprint, model=job.model_id, pid=os.getpid(),
                                started=time.time(),
                                requests=[{"request_id": j.id, "fingerprint": j.fingerprint} for j in jobs],
                                memory={"mlx_active_bytes": m.active_bytes, "mlx_peak_bytes": m.peak_bytes,
                                        "mlx_cache_bytes": m.cache_bytes}).write(self.inflight_path, durable=False)
        except OSError as exc:  # a full disk must not take requests down
            log.warning("cannot record the in-flight request: %s", exc)

    def _fatal(self, exc: BaseException, jobs: list[Job]) -> None:
        """An MLX fault: every request the worker holds gets an explicit
        error, and the engine exits for the supervisor to restart it."""
        held = {r.id for r in self.table.rows()}
        for job in jobs:  # every request named in the crash is held as running (one taken just now too)
            if job.id not in held:
                self.table.hold(job, RequestStatus.PREFILLING)
        self._publish(Phase.FAILED)
        error = EngineError(500, f"MLX error: {exc}; the engine is restarting", code="mlx_error", retry_after=5)
        for job in jobs:
            job.channel.put(Failed(error))
        self._stop_event.set()
        self.on_fatal(exc, jobs[0] if jobs else None)
