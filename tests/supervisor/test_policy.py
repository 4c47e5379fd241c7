"""The restart policy as tables of events and expected decisions."""

import pytest

from mlxd.config import SupervisorConfig
from mlxd.records import ExitRecord
from mlxd.supervisor.policy import (TRANSITIONS, EngineExited, EngineStarted, EngineStopped, Health,
                                    InvalidTransition, KillEngine, Mode, OperatorRestart, Policy, Reconciled,
                                    RecordCrash, StartEngine, State, Tick, backoff_delay, check_transition,
                                    decide)

P = Policy.from_config(SupervisorConfig(backoff_base_s=1, backoff_cap_s=8, healthy_reset_s=60, loop_crashes=5,
                                        loop_window_s=600, cooldown_s=300, health_failures=3, start_grace_s=30))
EXIT = ExitRecord(returncode=-6, ended=0.0)  # what the listener would hand over; the policy only carries it


def exited(t):
    return EngineExited(t, EXIT)


def crash(delay, degraded=False, killed_for=None):
    return RecordCrash(EXIT, delay, degraded, killed_for)


def run(events, state=State()):
    actions = []
    for ev in events:
        state, acts = decide(state, ev, P)
        actions.append(acts)
    return state, actions


@pytest.mark.parametrize("n, delay", [(1, 0), (2, 1), (3, 2), (4, 4), (5, 8), (6, 8), (20, 8)])
def test_backoff_delays_double_up_to_the_cap(n, delay):
    assert backoff_delay(n, P) == delay


def test_crash_after_a_healthy_run_restarts_at_once():
    state, actions = run([EngineStarted(0), exited(3600)])
    assert actions[-1] == [crash(0.0), StartEngine()]
    assert state.mode is Mode.STARTING and state.consecutive == 1


def test_quick_crashes_back_off_growing_then_degrade():
    t, state, delays = 0.0, State(), []
    for _ in range(4):
        state, _ = decide(state, EngineStarted(t), P)
        t += 1
        state, acts = decide(state, exited(t), P)
        delays.append(acts[0].restart_in_s)
        if state.mode is Mode.BACKOFF:
            state, acts = decide(state, Tick(state.restart_at - 0.01), P)
            assert acts == []  # not before its time
            t = state.restart_at
            state, acts = decide(state, Tick(t), P)
            assert acts == [StartEngine()]
    assert delays == [0.0, 1, 2, 4]
    state, _ = decide(state, EngineStarted(t), P)
    state, acts = decide(state, exited(t + 1), P)  # the 5th crash in the window
    assert state.mode is Mode.DEGRADED and acts == [crash(None, True)]
    assert state.restart_at == pytest.approx(t + 1 + 300)


def test_degraded_waits_out_the_cooldown_then_probation():
    state = State(mode=Mode.DEGRADED, restart_at=1000, crash_times=(1, 2, 3, 4, 5), consecutive=5)
    assert decide(state, Tick(999), P) == (state, [])
    state, acts = decide(state, Tick(1000), P)
    assert acts == [StartEngine()] and state.probation and state.crash_times == ()
    state, _ = decide(state, EngineStarted(1001), P)
    state, acts = decide(state, exited(1005), P)  # crashed on probation
    assert state.mode is Mode.DEGRADED and acts == [crash(None, True)]


def test_probation_passed_after_a_healthy_run():
    state = State(mode=Mode.STARTING, probation=True, consecutive=5)
    state, _ = decide(state, EngineStarted(0), P)
    state, _ = decide(state, Tick(61), P)
    assert state.consecutive == 0 and not state.probation
    state, acts = decide(state, exited(100), P)
    assert acts == [crash(0.0), StartEngine()]


@pytest.mark.parametrize("mode", [Mode.DEGRADED, Mode.BACKOFF, Mode.STOPPED, Mode.RUNNING])
def test_a_start_we_did_not_order_is_an_operator_restart_with_a_fresh_slate(mode):
    state = State(mode=mode, restart_at=1000, crash_times=(1, 2, 3, 4, 5), consecutive=5, probation=True)
    state, acts = decide(state, EngineStarted(10), P)
    assert acts == [] and state == State(mode=Mode.RUNNING, started_at=10)


def test_operator_restart_clears_a_crash_loop_and_waits_for_the_operators_start():
    state = State(mode=Mode.DEGRADED, restart_at=1000, crash_times=(1, 2, 3, 4, 5), consecutive=5)
    state, acts = decide(state, OperatorRestart(10), P)
    assert acts == [] and state == State(mode=Mode.STARTING)  # `mlxd restart` starts it, not us
    state, _ = decide(state, EngineStarted(11), P)
    assert state.mode is Mode.RUNNING and state.consecutive == 0 and state.crash_times == ()


def test_operator_restart_of_a_running_engine_passes_through_stopped():
    state, _ = run([EngineStarted(0), exited(5), EngineStarted(6)])  # one crash in the history
    for ev in (OperatorRestart(10), EngineStopped(11), EngineStarted(12)):
        state, acts = decide(state, ev, P)
        assert acts == []
    assert state == State(mode=Mode.RUNNING, started_at=12)


def test_a_start_we_ordered_keeps_the_crash_history():
    state = State(mode=Mode.STARTING, crash_times=(1, 2), consecutive=2)
    state, _ = decide(state, EngineStarted(10), P)
    assert state.mode is Mode.RUNNING and state.consecutive == 2 and state.crash_times == (1, 2)


def test_operator_stop_is_not_a_crash():
    state, _ = run([EngineStarted(0), EngineStopped(5)])
    state, acts = decide(state, exited(6), P)
    assert acts == [] and state.mode is Mode.STOPPED


@pytest.mark.parametrize("observations, kill_at", [
    ([Health(40, ok=False)] * 3, 2),                                        # three failures in a row
    ([Health(40, ok=False), Health(41, ok=True), Health(42, ok=False)], None),  # a success resets
    ([Health(10, ok=False)] * 5, None),                                     # still in the start grace
    ([Health(40, ok=False, unhealthy=True)], 0),                            # the engine says so: at once
    ([Health(40, ok=False, loading=True)] * 5, None),                       # loading is not failing
])
def test_hang_detection(observations, kill_at):
    state, _ = decide(State(), EngineStarted(0), P)
    kills = []
    for i, obs in enumerate(observations):
        state, acts = decide(state, obs, P)
        kills += [i for a in acts if isinstance(a, KillEngine)]
    assert kills == ([] if kill_at is None else [kill_at])


def test_a_killed_hang_is_recorded_as_such():
    state, _ = decide(State(), EngineStarted(0), P)
    state, _ = decide(state, Health(40, ok=False, unhealthy=True), P)
    state, acts = decide(state, exited(41), P)
    assert acts == [crash(0.0, killed_for="hang"), StartEngine()]


@pytest.mark.parametrize("saved, statename, expected_mode, restart_at", [
    (State(), "RUNNING", Mode.RUNNING, None),
    (State(mode=Mode.RUNNING, started_at=1), "EXITED", Mode.BACKOFF, 50),          # died while we were away
    (State(), "FATAL", Mode.BACKOFF, 50),
    (State(mode=Mode.BACKOFF, restart_at=70), "EXITED", Mode.BACKOFF, 70),         # a wait under way is kept
    (State(mode=Mode.DEGRADED, restart_at=300), "EXITED", Mode.DEGRADED, 300),     # so is a cool-down
    (State(mode=Mode.RUNNING, started_at=1), "STOPPED", Mode.STOPPED, None),
    (State(mode=Mode.STARTING), "STARTING", Mode.STARTING, None),                  # nothing to say yet
])
def test_reconcile_matches_supervisords_view(saved, statename, expected_mode, restart_at):
    state, acts = decide(saved, Reconciled(50, statename, started_at=40), P)
    assert acts == [] and state.mode is expected_mode and state.restart_at == restart_at
    if expected_mode is Mode.BACKOFF and restart_at == 50:
        state, acts = decide(state, Tick(50), P)
        assert acts == [StartEngine()] and state.mode is Mode.STARTING


def transitions_decide_makes() -> set[tuple[Mode, type, Mode]]:
    """(mode, event type, new mode) for every mode, in states varied where the
    code branches, through every kind of event."""
    events = [EngineStarted(10_000), exited(10_000), EngineStopped(10_000), OperatorRestart(10_000),
              Health(10_000, ok=False, unhealthy=True), Health(10_000, ok=False), Health(10_000, ok=True),
              Tick(50), Tick(10_000)]
    events += [Reconciled(10_000, name) for name in ("RUNNING", "EXITED", "FATAL", "BACKOFF", "STOPPED", "STARTING")]
    seen = set()
    for mode in Mode:
        for probation in (False, True):
            for crash_times in ((), (1, 2, 3, 4), (9000, 9001, 9002, 9003)):  # none, aged out, recent
                for consecutive in (0, 1, 4):
                    for started_at in (None, 0, 9990):  # a healthy run behind it, or not
                        for killing, failures in ((None, 0), ("hang", 5)):
                            state = State(mode=mode, started_at=started_at, restart_at=100, probation=probation,
                                          crash_times=crash_times, consecutive=consecutive, killing=killing,
                                          health_failures=failures)
                            seen |= {(mode, type(ev), decide(state, ev, P)[0].mode) for ev in events}
    return seen


def test_the_table_is_exactly_the_transitions_decide_makes():
    """Both ways: no move outside the table (decide would raise) and no entry that no event makes."""
    assert transitions_decide_makes() == {(m, ev, to) for (m, ev), tos in TRANSITIONS.items() for to in tos}


S, R, B, D, X = Mode.STARTING, Mode.RUNNING, Mode.BACKOFF, Mode.DEGRADED, Mode.STOPPED


@pytest.mark.parametrize("mode, event, allowed", [
    # the rules of the module's docstring, row by row
    (R, exited(1), {S, B, D}),          # a crash: at once after a healthy run, a back-off, or a loop
    (X, exited(1), {X}),                # a stopped engine's exit is no crash
    (D, Tick(1), {D, S}),               # the cool-down ends with one probation start
    (R, Tick(1), {R}),                  # the clock alone never moves a running engine
    (R, Health(1, ok=False, unhealthy=True), {R}),  # a hang is a kill; its exit moves the mode
    (D, EngineStarted(1), {R}),         # an operator's start clears a crash loop
    (B, OperatorRestart(1), {S}),
    (S, Reconciled(1, "STARTING"), {S, R, B, X}),
])
def test_the_table_by_hand(mode, event, allowed):
    assert TRANSITIONS[(mode, type(event))] == allowed


def test_a_transition_outside_the_table_is_refused():
    """A stopped engine's exit is no crash: nothing moves STOPPED to DEGRADED."""
    with pytest.raises(InvalidTransition, match="stopped -> degraded on EngineExited"):
        check_transition(Mode.STOPPED, Mode.DEGRADED, exited(1))
    check_transition(Mode.RUNNING, Mode.DEGRADED, exited(1))  # a crash loop from a running engine is fine


@pytest.mark.parametrize("crash_times, expected_mode, restart_at", [
    ((9500, 9501, 9502, 9503, 9504), Mode.DEGRADED, 10_300),  # still a loop: the cool-down starts again
    ((1, 2, 3, 4, 5), Mode.BACKOFF, 10_008),                   # the loop has left the window: a back-off
])
def test_a_crash_while_degraded(crash_times, expected_mode, restart_at):
    """supervisord started the engine meanwhile (its autostart after a reboot)
    and the start failed: a crash like any other."""
    state = State(mode=Mode.DEGRADED, restart_at=9804, crash_times=crash_times, consecutive=5)
    state, acts = decide(state, exited(10_000), P)
    assert state.mode is expected_mode and state.restart_at == restart_at and len(acts) == 1


def test_policy_numbers_come_from_the_config_alone():
    s = SupervisorConfig()
    p = Policy.from_config(s)
    assert (p.backoff_base_s, p.loop_crashes, p.cooldown_s) == (s.backoff_base_s, s.loop_crashes, s.cooldown_s)
    with pytest.raises(TypeError):
        Policy()  # no defaults of its own


@pytest.mark.parametrize("sup, engine_ok, mode, gateway_ok, expected", [
    (None, True, "running", True, "down"),
    (1, True, "running", True, "healthy"),
    (1, True, "running", None, "healthy"),          # engine only, no gateway configured
    (1, False, "degraded", True, "degraded"),      # Ollama serves through the gateway
    (1, False, "backoff", True, "degraded"),
    (1, True, "running", False, "down"),           # nobody can reach the engine
    (1, False, "stopped", True, "down"),
])
def test_overall_status(sup, engine_ok, mode, gateway_ok, expected):
    from mlxd.supervisor.status import overall
    assert overall(sup, engine_ok, mode, gateway_ok) == expected
