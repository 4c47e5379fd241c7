"""Reports: what one mlxd process tells another over HTTP or on stdout, one
frozen Record each, so that a key has one name and one type on both sides:

  report         where                     writer                readers
  EngineHealth   the engine's GET /health  engine/api/health.py      listener, journal, status, benchmarks
  StatusReport   `mlxd status [--json]`    supervisor/status.py  cli/operate.py (table: cli/status_format.py, or JSON)

Reports are lenient (see mlxd.records.Record): the engine on another host
may run an older or newer mlxd, so an unknown key is dropped and a missing
or mistyped one reads as its default -- `mlxd status` and the listener must
never fail on a neighbour's answer. Only a body without a `status` is no
EngineHealth at all (None). Readers parse a body once, with `from_json`,
and use attributes after that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from mlxd.records import Record, StandbyFile, StartedWith, SupervisionFile


class Report(Record):
    lenient: ClassVar[bool] = True


# --- the engine's /health ---------------------------------------------------------

@dataclass(frozen=True)
class KVCacheLayout(Report):
    """How the resident model's KV cache holds values, as served
    (mlxd.memory_estimate.KVLayout): `bits` 16 keeps the model's dtype."""

    bits: int = 16
    group_size: int = 64
    quantized_start: int = 0
    coarse_steps: bool = False  # buffers in coarse steps (MLX's CUDA backend: few lengths for cuDNN's graphs)


@dataclass(frozen=True)
class ServingPlanReport(Report):
    """How the resident model is served, decided at its load (engine/model/serving_plan.py)."""

    model: str = ""
    max_concurrency: int = 1
    decoder: str = "batch"  # "batch" (every text request) or "vision" (mlx-vlm's generation)
    vision: bool = False
    rank_group: bool = False
    prompt_cache: bool = True
    cpu_float32: bool = False
    reason: str | None = None  # why max_concurrency is below what was configured
    speculative: str = "off"  # a request decoded alone: "prompt_lookup", "draft" or "off"
    rows_apart: bool = False  # the batch decodes each row over its own cache (no padding, no mask)
    batch_speedup: float | None = None  # a batched step's tokens a second over one row's, measured at load
    mixed_prefill: bool = False  # joining prompts' chunks run in the decode step's forward (row_segments.py)


@dataclass(frozen=True)
class EngineMemory(Report):
    """MLX's memory as the worker last sampled it, the process's RSS and the
    engine's budget; the active bytes around the first load and the last
    unload (None until they happened) show what a model leaves behind."""

    mlx_active_bytes: int = 0
    mlx_peak_bytes: int = 0
    mlx_cache_bytes: int = 0
    mlx_sampled_s_ago: float = 0.0  # how old the three MLX figures are (sampled between steps, every second idle)
    rss_bytes: int = 0
    budget_bytes: int = 0
    mlx_active_before_first_load: int | None = None
    mlx_active_after_last_unload: int | None = None
    # MLX frees its buffer cache before active + cached memory would pass this: the budget less what the
    # process holds outside MLX (None: MLX's default)
    mlx_memory_limit_bytes: int | None = None
    # Where nvidia-smi sees the process: its device memory, and the most of it seen outside MLX (CUDA's
    # context, cuBLAS/cuDNN workspaces), which MLX's limit leaves room for (engine/core/device_memory.py)
    device_process_bytes: int | None = None
    outside_mlx_bytes: int | None = None


@dataclass(frozen=True)
class HeldRequestReport(Report):
    """One request the engine's worker holds (engine/core/request_table.py): its
    status ("waiting" for room in the batch, "prefilling", "decoding") and
    for how long it has had it."""

    id: str = ""
    status: str = ""
    for_s: float = 0.0


@dataclass(frozen=True)
class ReuseLine(Report):
    """One recent conversation's latest turn: how much of its prompt the
    cache reused, and where and why reuse stopped (engine/cache/prompt_cache.py
    writes it)."""

    conversation: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stopped_at: int | None = None  # None: every prompt token but the last was reused
    why: str = ""
    recomputed: int = 0
    source: str = "none"


@dataclass(frozen=True)
class PromptCacheReport(Report):
    """The prompt cache's figures, published by engine/cache/prompt_cache.py after every change."""

    enabled: bool = False
    disk_enabled: bool = False
    model: str | None = None
    memory_entries: int = 0
    memory_bytes: int = 0
    memory_budget_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_budget_bytes: int = 0
    requests: int = 0
    hits: int = 0
    disk_hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    disk_writes: int = 0
    disk_write_failures: int = 0
    disk_writes_pending: int = 0  # files the writer thread is writing now
    writing_bytes: int = 0  # evicted entries' arrays, held until their files are written
    disk_rejects: int = 0  # corrupt, partial or foreign files removed
    errors: int = 0  # faults in the cache's own bookkeeping (logged; the request went on cold)
    superseded: int = 0  # entries replaced by a later turn of their conversation
    recomputed_tokens: int = 0  # tokens recomputed inside reused KV (approximate reuse)
    recent: list[ReuseLine] = field(default_factory=list)  # newest last
    hit_rate: float = 0.0  # share of prompt tokens served from the cache

    nested: ClassVar[dict[str, type[Record]]] = {"recent": ReuseLine}


@dataclass(frozen=True)
class EngineHealth(Report):
    """The engine's GET /health body (200 when `status` is "ok", else 503).

    `running` lists every request generating now; None means an engine from
    before batching, which names only `in_flight` (the oldest request)."""

    status: str  # ok, loading, draining, exiting, unhealthy
    reason: str | None = None
    worker_alive: bool | None = None
    phase: str | None = None  # an engine.worker_state.Phase value
    resident_model: str | None = None
    kv_cache: KVCacheLayout | None = None
    tools: str | None = None  # who renders a request's tools for the resident model: "template" or "mlxd"
    embedding_model: str | None = None  # the embedding model resident beside the chat model (/v1/embeddings)
    reranker_model: str | None = None  # the cross-encoder reranker resident beside it (/v1/rerank)
    in_flight: str | None = None
    in_flight_fingerprint: str | None = None
    running: list[str] | None = None
    batch_size: int = 0
    requests: list[HeldRequestReport] = field(default_factory=list)  # every request held, oldest first
    max_concurrency: int | None = None  # the resident model's (its serving plan's); none resident: the queue's slots
    serving: ServingPlanReport | None = None
    queue_depth: int | None = None
    queue_capacity: int | None = None
    max_observed_concurrency: int | None = None
    memory: EngineMemory | None = None
    counters: dict[str, int] = field(default_factory=dict)
    prompt_cache: PromptCacheReport | None = None
    timings: dict[str, float] = field(default_factory=dict)  # last_load_s, last_unload_s
    keep_alive_s: float | None = None  # the model's idle time before it is given back; None: never
    unload_in_s: float | None = None  # until the resident model is given back, idle (None: not due)
    unloaded_idle_at: float | None = None  # wall clock: the model was given back, idle (none resident since)
    unloaded_idle_model: str | None = None  # the model given back
    uptime_s: float | None = None
    process_started_at: float | None = None  # wall clock: process spawn -> ready, for recovery timing
    ready_at: float | None = None
    pid: int | None = None

    nested: ClassVar[dict[str, type[Record]]] = {"kv_cache": KVCacheLayout, "memory": EngineMemory,
                                                 "serving": ServingPlanReport,
                                                 "requests": HeldRequestReport,
                                                 "prompt_cache": PromptCacheReport}

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def kv_bits(self) -> int:
        """Bits the resident model's KV cache holds values in (16: the model's dtype)."""
        return self.kv_cache.bits if self.kv_cache is not None else 16

    @property
    def load_s(self) -> float | None:
        """Seconds from the process's start to ready (None until ready)."""
        if self.ready_at is None or self.process_started_at is None:
            return None
        return round(self.ready_at - self.process_started_at, 3)


# --- `mlxd status` ------------------------------------------------------------------

@dataclass(frozen=True)
class EngineProbe(Report):
    """One GET of an engine's /health: `http_status` None when nothing
    answered, `health` None when the answer was no EngineHealth."""

    url: str
    http_status: int | None = None
    health: EngineHealth | None = None

    nested: ClassVar[dict[str, type[Record]]] = {"health": EngineHealth}

    @property
    def ok(self) -> bool:
        return self.http_status == 200


@dataclass(frozen=True)
class HostProbe(EngineProbe):
    """An engine on another host, with the models it serves (from `hosts`)."""

    models: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GatewayProbe(Report):
    """One GET of the gateway's /mlxd/health (its body: {"status": "ok"}, nothing more: it is open)."""

    url: str
    http_status: int | None = None
    health: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.http_status == 200


@dataclass(frozen=True)
class OllamaProbe(Report):
    url: str
    reachable: bool = False
    version: str | None = None


@dataclass(frozen=True)
class SupervisordState(Report):
    running: bool
    pid: int | None = None


@dataclass(frozen=True)
class ProcessInfo(Report):
    """One program of supervisord's process table."""

    name: str
    state: str  # supervisord's statename: RUNNING, BACKOFF, ...
    pid: int | None = None
    uptime_s: float | None = None  # None unless RUNNING
    description: str = ""


@dataclass(frozen=True)
class LastCrash(Report):
    """The crash journal's latest line, in brief ("class" in the JSON)."""

    time: float
    klass: str
    signal: str | None = None
    exit_code: int | None = None
    model: str | None = None
    request_id: str | None = None

    json_names: ClassVar[dict[str, str]] = {"klass": "class"}


@dataclass(frozen=True)
class CrashCounts(Report):
    last_hour: int = 0
    last_day: int = 0
    last: LastCrash | None = None

    nested: ClassVar[dict[str, type[Record]]] = {"last": LastCrash}


@dataclass(frozen=True)
class RankGroup(Report):
    """The engine's rank group (engine.ranks) and its ranks running on this Mac."""

    backend: str
    hosts: list[str] = field(default_factory=list)
    hostfile: str | None = None
    local_pids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ForeignListener(Report):
    """A process not ours listening on one of our ports ("for" in the JSON)."""

    port: int
    used_for: str  # engine or gateway
    pid: int
    cmdline: str = ""

    json_names: ClassVar[dict[str, str]] = {"used_for": "for"}


@dataclass(frozen=True)
class StatusReport(Report):
    """`mlxd status`: each part None (or empty) when its source is absent.
    `overall` is healthy, degraded or down; `autostart` (launchd's or
    systemd's summary) and `started_with` are added by the command."""

    time: float
    home: str
    overall: str
    supervisord: SupervisordState
    engine: EngineProbe
    crashes: CrashCounts = field(default_factory=CrashCounts)
    processes: list[ProcessInfo] | None = None
    gateway: GatewayProbe | None = None
    supervision: SupervisionFile | None = None
    standby: StandbyFile | None = None  # the standby keeper's waiting engine process (supervisor/standby.py)
    quarantined_requests: int = 0
    suspected_requests: int = 0  # in flight at a crash with others: the engine decodes them alone for a while
    ollama: OllamaProbe | None = None
    hosts: list[HostProbe] = field(default_factory=list)
    rank_group: RankGroup | None = None
    foreign_listeners: list[ForeignListener] = field(default_factory=list)
    autostart: dict[str, Any] | None = None
    started_with: StartedWith | None = None

    nested: ClassVar[dict[str, type[Record]]] = {
        "supervisord": SupervisordState, "engine": EngineProbe, "crashes": CrashCounts, "processes": ProcessInfo,
        "gateway": GatewayProbe, "supervision": SupervisionFile, "standby": StandbyFile, "ollama": OllamaProbe, "hosts": HostProbe,
        "rank_group": RankGroup, "foreign_listeners": ForeignListener, "started_with": StartedWith}
