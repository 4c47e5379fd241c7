"""Prometheus metrics for GET /metrics (prometheus_client, own registry).

Counters are incremented by the HTTP side; gauges read the worker's and the
admission queue's published snapshots at scrape time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from ..core.admission import AdmissionQueue
    from ..core.worker import ModelWorker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxd_engine_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejections = Counter("mlxd_engine_rejections", "Requests refused, by error code", ["code"],
                                  registry=r)
        self.ttft = Histogram("mlxd_engine_time_to_first_token_seconds", "Admission to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.queue_wait = Histogram("mlxd_engine_queue_wait_seconds", "Time spent waiting for the worker",
                                    registry=r, buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120))

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        Gauge(name, doc, registry=self.registry).set_function(read)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def register_gauges(metrics: EngineMetrics, worker: ModelWorker, admission: AdmissionQueue,
                    healthy: Callable[[], bool]) -> None:
    m, w = metrics, worker
    m.gauge("mlxd_engine_queue_depth", "Requests waiting for the worker", lambda: admission.snapshot()["waiting"])
    m.gauge("mlxd_engine_in_flight", "Requests generating now: the batch size (up to max_concurrency)",
            lambda: w.active_generations)
    m.gauge("mlxd_engine_max_concurrency", "Requests the resident model is decoded at once (its serving plan)",
            lambda: w.plan.max_concurrency if w.plan is not None else admission.slots)
    m.gauge("mlxd_engine_max_observed_concurrency", "Most generations ever seen at once",
            lambda: w.max_observed_concurrency)
    m.gauge("mlxd_engine_model_loads", "Models loaded since start", lambda: w.counters["model_loads"])
    m.gauge("mlxd_engine_model_unloads", "Models unloaded since start", lambda: w.counters["model_unloads"])
    m.gauge("mlxd_engine_idle_unloads", "Models given back after keep_alive without a request",
            lambda: w.counters["idle_unloads"])
    m.gauge("mlxd_engine_unload_in_seconds", "Until the resident model is given back if no request comes "
            "(-1: none resident, or keep_alive never)", lambda: -1 if (due := w.idle_unload[1]) is None else due)
    m.gauge("mlxd_engine_generated_tokens", "Tokens generated since start (counted as they are decoded)",
            lambda: w.counters["generated_tokens"])
    m.gauge("mlxd_engine_prompt_tokens", "Prompt tokens processed since start", lambda: w.counters["prompt_tokens"])
    for key, doc in (("spec_requests", "Requests decoded speculatively (prompt lookup or a draft model)"),
                     ("spec_proposed", "Tokens prompt lookup or the draft model proposed"),
                     ("spec_accepted", "Proposed tokens the model accepted"),
                     ("spec_forwards", "Forward passes of speculatively decoded requests"),
                     ("spec_tokens", "Tokens those forward passes produced"),
                     ("embedding_requests", "/v1/embeddings requests answered since start"),
                     ("embedding_inputs", "Inputs embedded since start"),
                     ("embedding_tokens", "Tokens of the inputs embedded since start"),
                     ("rerank_requests", "/v1/rerank requests answered since start"),
                     ("rerank_documents", "Documents ranked since start"),
                     ("rerank_tokens", "Tokens the rerankers read since start")):
        m.gauge(f"mlxd_engine_{key}", doc, lambda k=key: w.counters[k])
    m.gauge("mlxd_engine_mlx_active_bytes", "MLX active memory", lambda: w.memory.active_bytes)
    m.gauge("mlxd_engine_mlx_peak_bytes", "MLX peak memory", lambda: w.memory.peak_bytes)
    m.gauge("mlxd_engine_mlx_cache_bytes", "MLX buffer cache", lambda: w.memory.cache_bytes)
    m.gauge("mlxd_engine_rss_bytes", "Engine resident set size", lambda: psutil.Process().memory_info().rss)
    for field, doc in (("memory_bytes", "Bytes of cached prompt KV in memory"),
                       ("memory_entries", "Prompt-cache entries in memory"),
                       ("disk_bytes", "Bytes of cached prompt KV on disk"),
                       ("disk_entries", "Prompt-cache entries on disk"),
                       ("cached_tokens", "Prompt tokens served from the prompt cache since start"),
                       ("hits", "Requests that reused cached prompt KV since start"),
                       ("disk_hits", "Requests that reused prompt KV read from disk since start"),
                       ("evictions", "Prompt-cache entries evicted from memory since start"),
                       ("hit_rate", "Share of prompt tokens served from the prompt cache")):
        m.gauge(f"mlxd_engine_prompt_cache_{field}", doc, lambda f=field: getattr(w.cache_stats(), f))
    m.registry.register(RecentReuse(w))
    m.gauge("mlxd_engine_healthy", "1 when /health answers 200", lambda: 1 if healthy() else 0)


class RecentReuse:
    """Per recent conversation (the prompt cache's latest report of each):
    its prompt, what was reused and where exact reuse stopped, labelled by
    the cache's name for the conversation. A custom collector: the set of
    conversations changes between scrapes."""

    FIELDS = (("prompt_tokens", "Prompt tokens of the conversation's latest turn"),
              ("cached_tokens", "Prompt tokens of the conversation's latest turn served from the cache"),
              ("stopped_at", "Prompt token at which the latest turn's exact reuse stopped (absent: it did not)"))

    def __init__(self, worker: "ModelWorker") -> None:
        self.worker = worker

    def collect(self):
        recent = self.worker.cache_stats().recent
        for field, doc in self.FIELDS:
            family = GaugeMetricFamily(f"mlxd_engine_prompt_cache_{field}", doc, labels=["conversation"])
            for report in recent:
                value = getattr(report, field)
                if value is not None:
                    family.add_metric([report.conversation], value)
            yield family
