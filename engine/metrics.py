"""Prometheus metrics for GET /metrics (prometheus_client, own registry).

Counters are incremented by the HTTP side; gauges read the worker's and the
admission queue's published snapshots at scrape time.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
