"""The restart policy as tables of events and expected decisions."""

import pytest

from mlxd.supervisor.policy import (EngineExited, EngineStarted, Health, KillEngine, Mode, OperatorRestart,
                                    OperatorStop, Policy, RecordCrash, StartEngine, State, Tick, backoff_delay,
                                    decide)

P = Policy(backoff_base_s=1, backoff_cap_s=8, healthy_reset_s=60, loop_crashes=5, loop_window_s=600,
           cooldown_s=300, health_failures=3, start_grace_s=30)


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
    state, actions = run([EngineStarted(0), EngineExited(3600, crash=True)])
    assert actions[-1] == [RecordCrash(0.0, False), StartEngine()]
    assert state.mode is Mode.STARTING and state.consecutive == 1


def test_quick_crashes_back_off_growing_then_degrade():
    t, state, delays = 0.0, State(), []
    for _ in range(4):
        state, _ = decide(state, EngineStarted(t), P)
        t += 1
        state, acts = decide(state, EngineExited(t, crash=True), P)
        delays.append(acts[0].restart_in_s)
        if state.mode is Mode.BACKOFF:
            state, acts = decide(state, Tick(state.restart_at - 0.01), P)
            assert acts == []  # not before its time
            t = state.restart_at
            state, acts = decide(state, Tick(t), P)
            assert acts == [StartEngine()]
    assert delays == [0.0, 1, 2, 4]
    state, _ = decide(state, EngineStarted(t), P)
    state, acts = decide(state, EngineExited(t + 1, crash=True), P)  # the 5th crash in the window
    assert state.mode is Mode.DEGRADED and acts == [RecordCrash(None, True)]
    assert state.restart_at == pytest.approx(t + 1 + 300)


def test_degraded_waits_out_the_cooldown_then_probation():
    state = State(mode=Mode.DEGRADED, restart_at=1000, crash_times=(1, 2, 3, 4, 5), consecutive=5)
    assert decide(state, Tick(999), P) == (state, [])
    state, acts = decide(state, Tick(1000), P)
    assert acts == [StartEngine()] and state.probation and state.crash_times == ()
    state, _ = decide(state, EngineStarted(1001), P)
    state, acts = decide(state, EngineExited(1005, crash=True), P)  # crashed on probation
    assert state.mode is Mode.DEGRADED and acts == [RecordCrash(None, True)]


def test_probation_passed_after_a_healthy_run():
    state = State(mode=Mode.STARTING, probation=True, consecutive=5)
    state, _ = decide(state, EngineStarted(0), P)
    state, _ = decide(state, Tick(61), P)
    assert state.consecutive == 0 and not state.probation
    state, acts = decide(state, EngineExited(100, crash=True), P)
    assert acts == [RecordCrash(0.0, False), StartEngine()]


def test_operator_restart_clears_degraded():
    state = State(mode=Mode.DEGRADED, restart_at=1000, crash_times=(1, 2, 3, 4, 5), consecutive=5)
    state, acts = decide(state, OperatorRestart(10), P)
    assert acts == [StartEngine()] and state == State(mode=Mode.STARTING)


def test_operator_stop_is_not_a_crash():
    state, _ = run([EngineStarted(0), OperatorStop(5)])
    state, acts = decide(state, EngineExited(6, crash=True), P)
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
    state, acts = decide(state, EngineExited(41, crash=True), P)
    assert acts == [RecordCrash(0.0, False, "hang"), StartEngine()]


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
