"""GET /health: the engine's state in one answer, for the supervisor, the
gateway and operators.

`stuck_reason` and `health_state` are the pure decisions; `Health` gathers
their inputs from the worker, the admission queue and the Lifecycle into
the body (mlxd.reports.EngineHealth: this is its one writer), and owns one
piece of state: the engine declared itself unhealthy (a stuck worker), for
good.
"""

from __future__ import annotations

import dataclasses
import os
import time

import psutil

import mlxd
from mlxd.reports import EngineHealth, EngineMemory, HeldRequestReport, KVCacheLayout, ServingPlanReport

from ..core.admission import AdmissionQueue
from ..model.errors import EngineError
from ..model.job import Job
from .lifecycle import Lifecycle
from ..core.request_table import RequestStatus
from ..core.worker import Phase, WorkerStatus

LOAD_TIMEOUT_S = 1800.0  # a load (with download) longer than this counts as stuck


def stuck_reason(status: WorkerStatus, now: float, stuck_grace_s: float) -> str | None:
    """Why the worker counts as stuck, or None (pure)."""
    if status.phase in (Phase.PREFILL, Phase.DECODE) and now - status.last_progress > stuck_grace_s:
        return f"worker made no progress on {status.in_flight} for {now - status.last_progress:.0f}s"
    if status.phase is Phase.LOADING and now - status.since > LOAD_TIMEOUT_S:
        return f"model load running for {now - status.since:.0f}s"
    return None


def health_state(worker_alive: bool, phase: Phase, exiting_reason: str | None, unhealthy_reason: str | None,
                 draining: bool, ready: bool) -> tuple[str, str | None]:
    """(status, reason) for /health (pure; the first that holds wins)."""
    if not worker_alive and phase is not Phase.STOPPED:
        return "unhealthy", "the model worker thread is not running"
    if exiting_reason:
        return "exiting", exiting_reason
    if phase is Phase.FAILED:  # the worker failed and the loop has not yet set exiting_reason: never "ok"
        return "exiting", "fatal: the model worker failed"
    if unhealthy_reason:
        return "unhealthy", unhealthy_reason
    if draining:
        return "draining", "shutting down"
    if not ready:
        return "loading", "preloading the default model"
    return "ok", None


class Health:
    def __init__(self, lifecycle: Lifecycle, admission: AdmissionQueue[Job], budget_bytes: int,
                 stuck_grace_s: float) -> None:
        self.lifecycle = lifecycle
        self.worker = lifecycle.worker
        self.admission = admission
        self.budget_bytes = budget_bytes
        self.stuck_grace_s = stuck_grace_s
        self.started_at = time.monotonic()
        self.unhealthy_reason: str | None = None

    def stuck_reason(self) -> str | None:
        return stuck_reason(self.worker.status, time.monotonic(), self.stuck_grace_s)

    def check_progress(self, job_id: str) -> None:
        """Raise the 503 `engine_stuck` when the worker is stuck on this job;
        the engine stays unhealthy from then on (the supervisor restarts it)."""
        stuck = self.stuck_reason()
        if stuck and job_id in self.worker.status.in_flight_ids:
            self.unhealthy_reason = f"stuck: {stuck}"
            raise EngineError(503, f"the engine stopped making progress ({stuck}); it will be restarted",
                              code="engine_stuck", retry_after=10)

    def waiting_for_room(self, job_id: str) -> bool:
        """Whether the worker holds this job waiting for room in the batch
        (taken from the queue, not yet running): the published snapshot."""
        return any(r.id == job_id and r.status is RequestStatus.WAITING for r in self.worker.status.requests)

    def state(self) -> tuple[str, str | None]:
        w, life = self.worker, self.lifecycle
        return health_state(w.is_alive(), w.status.phase, life.exiting_reason,
                            self.unhealthy_reason or self.stuck_reason(), life.draining, w.ready.is_set())

    def record(self) -> EngineHealth:
        """/health's body, as gathered now."""
        status, reason = self.state()
        w = self.worker
        s, mem, queue, plan = w.status, w.memory, self.admission.snapshot(), w.plan
        device = w.device_memory.latest if w.device_memory is not None else None
        keep_alive, unload_in, unloaded_at, unloaded_model = w.idle_unload
        return EngineHealth(
            status=status,
            reason=reason,
            worker_alive=w.is_alive(),
            phase=s.phase.value,
            resident_model=s.resident_model,
            # How the resident model's KV holds values, as served (not as configured).
            kv_cache=KVCacheLayout(**dataclasses.asdict(w.resident_kv)) if w.resident_kv is not None else None,
            tools=w.resident_tools,
            embedding_model=w.resident_encoder,
            reranker_model=w.resident_reranker,
            in_flight=s.in_flight,
            in_flight_fingerprint=s.in_flight_fingerprint,
            running=list(s.in_flight_ids),  # every request generating now (several when batching)
            batch_size=len(s.in_flight_ids),
            requests=[HeldRequestReport(id=r.id, status=r.status.value, for_s=round(time.monotonic() - r.since, 3))
                      for r in s.requests],
            max_concurrency=plan.max_concurrency if plan is not None else queue["slots"],
            serving=ServingPlanReport(model=plan.model_id, max_concurrency=plan.max_concurrency, decoder=plan.decoder,
                                      vision=plan.vision, rank_group=plan.rank_group, prompt_cache=plan.prompt_cache,
                                      cpu_float32=plan.cpu_float32, reason=plan.reason,
                                      speculative=plan.speculative, rows_apart=plan.rows_apart,
                                      batch_speedup=plan.batch_speedup, mixed_prefill=plan.mixed_prefill)
            if plan is not None else None,
            queue_depth=queue["waiting"],
            queue_capacity=queue["capacity"],
            max_observed_concurrency=w.max_observed_concurrency,
            memory=EngineMemory(
                mlx_active_bytes=mem.active_bytes,
                mlx_peak_bytes=mem.peak_bytes,
                mlx_cache_bytes=mem.cache_bytes,
                mlx_sampled_s_ago=round(max(0.0, time.monotonic() - mem.taken_at), 3),
                rss_bytes=psutil.Process().memory_info().rss,
                budget_bytes=self.budget_bytes,
                mlx_active_before_first_load=w.active_before_first_load,
                mlx_active_after_last_unload=w.active_after_last_unload,
                mlx_memory_limit_bytes=w.mlx_memory_limit,
                device_process_bytes=device.process_bytes if device else None,
                outside_mlx_bytes=device.outside_bytes if device else None,
            ),
            counters=dict(w.counters),
            prompt_cache=w.cache_stats(),
            timings=dict(w.timings),
            keep_alive_s=None if keep_alive == float("inf") else keep_alive,
            unload_in_s=unload_in,
            unloaded_idle_at=unloaded_at,
            unloaded_idle_model=unloaded_model,
            uptime_s=round(time.monotonic() - self.started_at, 3),
            process_started_at=mlxd.STARTED_AT,
            ready_at=w.ready_at,
            pid=os.getpid(),
        )

    def report(self) -> tuple[int, dict]:
        """/health's status code and body (JSON)."""
        health = self.record()
        return (200 if health.ok else 503), health.to_json()
