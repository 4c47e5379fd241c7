"""Restart policy for the engine: backoff, crash loops, hangs (pure).

`decide(state, event, policy) -> (state, actions)`: no clocks, no I/O; the
crash listener turns what it sees (supervisord's process events, /health
polls, the clock, its own start-up) into events, and carries the actions
out. Every change of mode goes through `decide`, which checks it against
TRANSITIONS (as supervisord's states.py and llama-swap's isValidTransition
do), so an impossible transition is a bug caught where it happens.

The rules (the numbers are [supervisor]'s, documented in docs/CONFIG.md):
- A crash after a healthy run (up >= healthy_reset_s) restarts at once.
- Crashes in a row without such a run wait backoff_base_s * 2^(n-2), capped
  at backoff_cap_s.
- loop_crashes crashes within loop_window_s is a crash loop: no restarts for
  cooldown_s -- "degraded", the gateway serves through Ollama -- then one
  probation start; a crash during probation (before a healthy run) goes
  straight back to degraded. An operator's start clears it all.
- An engine that says it is unhealthy, or fails health_failures polls in a
  row after start_grace_s, is killed (a "hang") and handled as a crash.
Compared with systemd (default StartLimitBurst=5 in StartLimitIntervalSec=10 s,
then the unit stays failed until reset) we retry by ourselves after a
cool-down; compared with Kubernetes (CrashLoopBackOff: 10 s doubling to
300 s, reset after 10 min of running) we restart a healthy engine at once --
a Metal abort after an hour of service is not a loop -- and cap sooner.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, replace
from typing import Any

from mlxd.config import SupervisorConfig
from mlxd.records import ExitRecord


@dataclass(frozen=True)
class Policy:
    """The numbers behind every decision; built from [supervisor] only (the
    defaults live in one place: mlxd.config.SupervisorConfig)."""

    backoff_base_s: float
    backoff_cap_s: float
    healthy_reset_s: float
    loop_crashes: int
    loop_window_s: float
    cooldown_s: float
    health_failures: int  # consecutive failed health polls that make a hang
    start_grace_s: float  # a starting engine may not answer /health yet

    @classmethod
    def from_config(cls, s: SupervisorConfig) -> "Policy":
        return cls(backoff_base_s=s.backoff_base_s, backoff_cap_s=s.backoff_cap_s, healthy_reset_s=s.healthy_reset_s,
                   loop_crashes=s.loop_crashes, loop_window_s=s.loop_window_s, cooldown_s=s.cooldown_s,
                   health_failures=s.health_failures, start_grace_s=s.start_grace_s)


class Mode(enum.Enum):
    STARTING = "starting"  # we asked supervisord to start it; not yet running
    RUNNING = "running"
    BACKOFF = "backoff"  # crashed; waiting to restart
    DEGRADED = "degraded"  # crash loop; waiting out the cool-down
    STOPPED = "stopped"  # stopped through supervisord (an operator, mlxd down)


class InvalidTransition(RuntimeError):
    pass


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

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["mode"] = self.mode.value
        d["crash_times"] = list(self.crash_times)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "State":
        """Raises TypeError/ValueError on a state that is not one."""
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        fields["mode"] = Mode(fields.get("mode", "starting"))
        fields["crash_times"] = tuple(fields.get("crash_times", ()))
        return cls(**fields)


# --- events ----------------------------------------------------------------

@dataclass(frozen=True)
class EngineStarted:
    """supervisord says the engine is RUNNING. In STARTING we asked for it;
    in any other mode an operator started it: a fresh slate."""

    t: float


@dataclass(frozen=True)
class EngineExited:
    """The engine exited without being asked to through supervisord (a crash,
    a kill for a hang, or an exit of its own); `exit` is what we know of it."""

    t: float
    exit: ExitRecord


@dataclass(frozen=True)
class EngineStopped:
    """supervisord stopped it on request (mlxd down, an operator's stop)."""

    t: float


@dataclass(frozen=True)
class OperatorRestart:
    """`mlxd restart engine` said so (before it stops and starts the engine
    itself): the crash history, a crash loop included, is cleared."""

    t: float


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
class Reconciled:
    """The listener (re)started and read supervisord's view of the engine:
    `statename` is supervisord's (RUNNING, EXITED, FATAL, BACKOFF, STOPPED...)."""

    t: float
    statename: str
    started_at: float | None = None


Event = EngineStarted | EngineExited | EngineStopped | OperatorRestart | Health | Tick | Reconciled


# --- which moves each event may make -------------------------------------------

S, R, B, D, X = Mode.STARTING, Mode.RUNNING, Mode.BACKOFF, Mode.DEGRADED, Mode.STOPPED
EVERY_MODE = (S, R, B, D, X)
# (mode, event) -> the modes decide may move to: written by hand from the
# rules above, and checked both ways (tests/supervisor/test_policy.py):
# decide never makes a move outside it (check_transition raises) and makes
# every move in it.
TRANSITIONS: dict[tuple[Mode, type], frozenset[Mode]] = {
    # An operator's start, stop or restart means the same in every mode.
    **{(m, EngineStarted): frozenset({R}) for m in EVERY_MODE},
    **{(m, EngineStopped): frozenset({X}) for m in EVERY_MODE},
    **{(m, OperatorRestart): frozenset({S}) for m in EVERY_MODE},
    # Health never moves the mode: a hang is a KillEngine, and the exit that follows moves it.
    **{(m, Health): frozenset({m}) for m in EVERY_MODE},
    # A crash: a restart at once after a healthy run (S), a back-off, or a crash loop.
    **{(m, EngineExited): frozenset({S, B, D}) for m in (S, R, B, D)},
    (X, EngineExited): frozenset({X}),  # a stopped engine's exit is no crash
    # The clock ends a wait (a back-off, a cool-down), and does nothing else.
    (S, Tick): frozenset({S}), (R, Tick): frozenset({R}), (X, Tick): frozenset({X}),
    (B, Tick): frozenset({B, S}), (D, Tick): frozenset({D, S}),
    # supervisord's view on the listener's (re)start: RUNNING, STOPPED, or EXITED/FATAL (the engine died
    # while the listener was away: a back-off, unless a wait is under way); STARTING says nothing yet.
    (S, Reconciled): frozenset({S, R, B, X}), (R, Reconciled): frozenset({R, B, X}),
    (B, Reconciled): frozenset({B, R, X}), (D, Reconciled): frozenset({D, R, X}), (X, Reconciled): frozenset({X, R, B}),
}


# --- actions -----------------------------------------------------------------

@dataclass(frozen=True)
class StartEngine:
    pass


@dataclass(frozen=True)
class KillEngine:
    reason: str


@dataclass(frozen=True)
class RecordCrash:
    """Journal this exit (and log it). `exit` is the event's, handed through."""

    exit: ExitRecord
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
    new, actions = _decide(state, event, policy)
    check_transition(state.mode, new.mode, event)
    return new, actions


def check_transition(old: Mode, new: Mode, event: Event) -> None:
    """Raises InvalidTransition unless TRANSITIONS allows old -> new on this event."""
    if new not in TRANSITIONS[(old, type(event))]:
        raise InvalidTransition(f"{old.value} -> {new.value} on {type(event).__name__}")


def _decide(state: State, event: Event, policy: Policy) -> tuple[State, list[Action]]:
    if isinstance(event, EngineStopped):
        return replace(state, mode=Mode.STOPPED, restart_at=None, killing=None), []
    if isinstance(event, OperatorRestart):  # the operator's command starts it: no StartEngine of ours
        return State(mode=Mode.STARTING), []
    if isinstance(event, EngineStarted):
        if state.mode is Mode.STARTING:
            return replace(state, mode=Mode.RUNNING, started_at=event.t, health_failures=0, killing=None), []
        return State(mode=Mode.RUNNING, started_at=event.t), []  # an operator's start: crash history cleared
    if isinstance(event, EngineExited):
        return _on_exit(state, event, policy)
    if isinstance(event, Health):
        return _on_health(state, event, policy)
    if isinstance(event, Reconciled):
        return _on_reconcile(state, event)
    return _on_tick(state, event, policy)


def _on_exit(state: State, event: EngineExited, policy: Policy) -> tuple[State, list[Action]]:
    if state.mode is Mode.STOPPED:
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
        return degraded, [RecordCrash(event.exit, None, True, state.killing)]
    delay = backoff_delay(consecutive, policy)
    if delay == 0:
        return replace(base, mode=Mode.STARTING, restart_at=None, probation=False), \
            [RecordCrash(event.exit, 0.0, False, state.killing), StartEngine()]
    return replace(base, mode=Mode.BACKOFF, restart_at=t + delay, probation=False), \
        [RecordCrash(event.exit, delay, False, state.killing)]


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


def _on_reconcile(state: State, event: Reconciled) -> tuple[State, list[Action]]:
    """Match the (resumed or fresh) state to the engine's real one. An engine
    that is down and not already waiting to restart is restarted on the next
    tick; a wait already under way (backoff, cool-down) is kept."""
    if event.statename == "RUNNING":
        return replace(state, mode=Mode.RUNNING, started_at=event.started_at or event.t), []
    if event.statename in ("EXITED", "FATAL", "BACKOFF") and state.mode not in (Mode.DEGRADED, Mode.BACKOFF):
        return replace(state, mode=Mode.BACKOFF, restart_at=event.t), []
    if event.statename == "STOPPED":
        return replace(state, mode=Mode.STOPPED), []
    return state, []
