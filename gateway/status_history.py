"""The status page's last hour: memory, requests and tok/s, sampled from
the engine's /health by one asyncio task of the gateway process.

`point_from` and `tokens_per_s` are the pure parts (tested as tables);
`HistorySampler` is their shell and the one owner of the ring of points.
/health carries everything plotted (memory, the request table, the prompt
cache and the generated-tokens counter that /metrics also exports), so one
GET a sample is enough. A failed GET is a point with no figures (a gap in
the plots), never an error of the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass

import aiohttp

from mlxd.keyfile import KeyFile
from mlxd.reports import EngineHealth

log = logging.getLogger("mlxd.gateway.status")

SPAN_S = 3600.0  # what the page plots: the last hour
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Counted:
    """The engine's generated-tokens counter as read at `t` from process `pid`."""

    t: float
    pid: int | None
    tokens: int


@dataclass(frozen=True)
class Point:
    """One sample as the page plots it; None where the engine did not say."""

    t: float
    rss_bytes: int | None = None
    device_bytes: int | None = None  # the process's device memory, where nvidia-smi sees it
    mlx_active_bytes: int | None = None
    mlx_cache_bytes: int | None = None
    prompt_cache_bytes: int | None = None
    running: int | None = None
    queued: int | None = None
    tok_s: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def tokens_per_s(last: Counted | None, now: Counted | None) -> float | None:
    """Tokens generated a second between two readings of the counter (pure).
    The engine counts tokens as they are generated (each decode step), so
    this is the rate of the answers running between them. A counter from
    another process (a restart, a standby's takeover) or one that went back
    started at zero after `last` was read: all of it is new."""
    if last is None or now is None or now.t <= last.t:
        return None
    same_run = now.pid == last.pid and now.tokens >= last.tokens
    made = now.tokens - last.tokens if same_run else now.tokens
    return round(made / (now.t - last.t), 2)


def request_counts(health: EngineHealth) -> tuple[int, int]:
    """(running, queued): requests generating now, and those waiting, in the
    admission queue or held by the worker for room in the batch (pure)."""
    waiting = sum(1 for r in health.requests if r.status == "waiting")
    running = len(health.running) if health.running is not None else int(health.in_flight is not None)
    return running, (health.queue_depth or 0) + waiting


def point_from(t: float, health: EngineHealth | None, last: Counted | None) -> tuple[Point, Counted | None]:
    """The point for one /health answer (None: no answer) and the counter
    reading to derive the next point's tok/s from (pure)."""
    if health is None:
        return Point(t), last
    counted = None
    if "generated_tokens" in health.counters:
        counted = Counted(t, health.pid, health.counters["generated_tokens"])
    mem, cache = health.memory, health.prompt_cache
    running, queued = request_counts(health)
    point = Point(t, rss_bytes=mem.rss_bytes if mem else None, device_bytes=mem.device_process_bytes if mem else None,
                  mlx_active_bytes=mem.mlx_active_bytes if mem else None,
                  mlx_cache_bytes=mem.mlx_cache_bytes if mem else None,
                  prompt_cache_bytes=cache.memory_bytes if cache and cache.enabled else None,
                  running=running, queued=queued, tok_s=tokens_per_s(last, counted))
    return point, counted or last


def within(points: list[Point], now: float, span_s: float = SPAN_S) -> list[Point]:
    """The points of the last `span_s` seconds, oldest first (pure)."""
    return [p for p in points if now - span_s <= p.t <= now]


class HistorySampler:
    """Samples the engine's /health every `interval_s` into a ring of an
    hour's points. One task (started with `start()` at the gateway's
    lifespan) writes the ring; `points()` reads it on the same event loop."""

    def __init__(self, engine_url: str, interval_s: float, engine_key: KeyFile) -> None:
        self.health_url = engine_url + "/health"
        self.engine_key = engine_key
        self.interval_s = interval_s
        self.ring: deque[Point] = deque(maxlen=int(SPAN_S / interval_s) + 2)
        self.last: Counted | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name="mlxd-status-history")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None

    def points(self, now: float | None = None) -> list[Point]:
        return within(list(self.ring), time.time() if now is None else now)

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as session:
            while True:
                health = await self._read(session)
                point, self.last = point_from(time.time(), health, self.last)
                self.ring.append(point)
                await asyncio.sleep(self.interval_s)

    async def _read(self, session: aiohttp.ClientSession) -> EngineHealth | None:
        try:
            async with session.get(self.health_url, headers=self.engine_key.headers()) as resp:
                return EngineHealth.from_json(await resp.json(content_type=None))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return None
        except Exception:  # noqa: BLE001 - the history is a nicety: it never takes the gateway down
            log.exception("status history: reading the engine's /health failed")
            return None
