"""Restart policy for the engine: backoff, crash loops, hangs (pure).

`decide(state, event, policy) -> (state, actions)`: no clocks, no I/O; the
crash listener feeds it events and carries the actions out.

Numbers (defaults, all configurable under [supervisor]):
- A crash after a healthy run (>= healthy_reset_s up) restarts at once.
- Crashes in a row without such a run wait backoff_base_s * 2^(n-2):
  0, 1, 2, 4, 8, 16, 32, 60 (cap) seconds.
- loop_crashes (5) crashes within loop_window_s (600 s) is a crash loop:
  no restarts for cooldown_s (300 s) -- "degraded", the gateway serves
  through Ollama -- then one probation start; a crash during probation
  (before a healthy run) goes straight back to degraded. An operator's
  restart clears it all.
Compared with systemd (default StartLimitBurst=5 in StartLimitIntervalSec=10 s,
then the unit stays failed until reset) we retry by ourselves after a
cool-down; compared with Kubernetes (CrashLoopBackOff: 10 s doubling to
300 s, reset after 10 min of running) we restart a healthy engine at once --
a Metal abort after an hour of service is not a loop -- and cap sooner.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Policy:
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    healthy_reset_s: float = 120.0
    loop_crashes: int = 5
    loop_window_s: float = 600.0
    cooldown_s: float = 300.0
    health_failures: int = 3  # consecutive failed health polls that make a hang
    start_grace_s: float = 120.0  # a starting engine may not answer /health yet


class Mode(enum.Enum):
    STARTING = "starting"  # start requested, not yet running
    RUNNING = "running"
    BACKOFF = "backoff"  # crashed; waiting to restart
    DEGRADED = "degraded"  # crash loop; waiting out the cool-down
    STOPPED = "stopped"  # an operator stopped it


@dataclass(frozen=True)
class State:
    mode: Mode = Mode.STARTING
    started_at: float | None = None
    consecutive: int = 0  # crashes with no healthy run in between
    crash_times: tuple[float, ...] = ()
    restart_at: float | None = None  # BACKOFF / DEGRADED: when to start again
    probation: bool = False  # started after a cool-down
    health_failures: int = 0
    killing: str | None = None  # why we killed it (a hang), until it exits


# --- events ----------------------------------------------------------------

@dataclass(frozen=True)
class EngineStarted:
    t: float


@dataclass(frozen=True)
class EngineExited:
    t: float
    crash: bool  # False for a stop we (or an operator) asked for


@dataclass(frozen=True)
class Health:
    t: float
    ok: bool
    unhealthy: bool = False  # the engine itself says it cannot serve (stuck, fatal)
    loading: bool = False  # preloading / draining: alive, not failing


@dataclass(frozen=True)
class Tick:
    t: float


@dataclass(frozen=True)
class OperatorRestart:
    t: float


@dataclass(frozen=True)
class OperatorStop:
    t: float


Event = EngineStarted | EngineExited | Health | Tick | OperatorRestart | OperatorStop


# --- actions -----------------------------------------------------------------

@dataclass(frozen=True)
class StartEngine:
    pass


@dataclass(frozen=True)
class KillEngine:
    reason: str


@dataclass(frozen=True)
class RecordCrash:
    restart_in_s: float | None  # None: degraded, no restart scheduled
    degraded: bool
    killed_for: str | None = None  # e.g. "hang" when we killed it


Action = StartEngine | KillEngine | RecordCrash


def backoff_delay(consecutive: int, policy: Policy) -> float:
    """Delay before restart number `consecutive` (1 = first crash) (pure)."""
    if consecutive <= 1:
        return 0.0
    return min(policy.backoff_base_s * 2 ** (consecutive - 2), policy.backoff_cap_s)


def decide(state: State, event: Event, policy: Policy) -> tuple[State, list[Action]]:
    if isinstance(event, OperatorRestart):
        return State(mode=Mode.STARTING), [StartEngine()]
    if isinstance(event, OperatorStop):
        return replace(state, mode=Mode.STOPPED, restart_at=None, killing=None), []
    if isinstance(event, EngineStarted):
        if state.mode is Mode.STOPPED:
            return state, []
        return replace(state, mode=Mode.RUNNING, started_at=event.t, health_failures=0, killing=None), []
    if isinstance(event, EngineExited):
        return _on_exit(state, event, policy)
    if isinstance(event, Health):
        return _on_health(state, event, policy)
    return _on_tick(state, event, policy)


def _on_exit(state: State, event: EngineExited, policy: Policy) -> tuple[State, list[Action]]:
    if state.mode is Mode.STOPPED or not event.crash:
        return replace(state, killing=None), []
    t = event.t
    uptime = t - state.started_at if state.started_at is not None else 0.0
    healthy_run = uptime >= policy.healthy_reset_s
    consecutive = 1 if healthy_run else state.consecutive + 1
    recent = tuple(c for c in state.crash_times if t - c < policy.loop_window_s) + (t,)
    base = replace(state, started_at=None, consecutive=consecutive, crash_times=recent, health_failures=0,
                   killing=None)
    if (state.probation and not healthy_run) or len(recent) >= policy.loop_crashes:
        degraded = replace(base, mode=Mode.DEGRADED, restart_at=t + policy.cooldown_s, probation=False)
        return degraded, [RecordCrash(None, True, state.killing)]
    delay = backoff_delay(consecutive, policy)
    if delay == 0:
        return replace(base, mode=Mode.STARTING, restart_at=None, probation=False), \
            [RecordCrash(0.0, False, state.killing), StartEngine()]
    return replace(base, mode=Mode.BACKOFF, restart_at=t + delay, probation=False), \
        [RecordCrash(delay, False, state.killing)]


def _on_tick(state: State, event: Tick, policy: Policy) -> tuple[State, list[Action]]:
    t = event.t
    if state.mode is Mode.BACKOFF and state.restart_at is not None and t >= state.restart_at:
        return replace(state, mode=Mode.STARTING, restart_at=None), [StartEngine()]
    if state.mode is Mode.DEGRADED and state.restart_at is not None and t >= state.restart_at:
        return replace(state, mode=Mode.STARTING, restart_at=None, crash_times=(), probation=True), [StartEngine()]
    if (state.mode is Mode.RUNNING and state.started_at is not None and state.consecutive
            and t - state.started_at >= policy.healthy_reset_s):
        return replace(state, consecutive=0, probation=False), []
    return state, []


def _on_health(state: State, event: Health, policy: Policy) -> tuple[State, list[Action]]:
    if state.mode is not Mode.RUNNING or state.killing is not None:
        return state, []
    if event.ok or event.loading:
        return (replace(state, health_failures=0) if state.health_failures else state), []
    if event.unhealthy:  # the engine says so itself: no need to wait for more polls
        return replace(state, killing="hang"), [KillEngine("the engine reports itself unhealthy")]
    failures = state.health_failures + 1
    in_grace = state.started_at is not None and event.t - state.started_at < policy.start_grace_s
    if failures >= policy.health_failures and not in_grace:
        return replace(state, health_failures=failures, killing="hang"), \
            [KillEngine(f"/health failed {failures} times in a row")]
    return replace(state, health_failures=failures), []
