"""What the listener hands the policy for one exit (pure), as a table."""

import signal

import pytest

from mlxd.records import EngineExit, InflightRequest
from mlxd.supervisor.listener import exit_record

RUNNER_EXIT = EngineExit(pid=11, runner_pid=10, returncode=-6, started=1.0, ended=2.0)
INFLIGHT = InflightRequest(request_id="r", fingerprint="f", model="m", pid=11, started=1.5)


@pytest.mark.parametrize("runner_exit, runner_pid, expected_by_supervisord, want", [
    (RUNNER_EXIT, 10, False, dict(returncode=-6, pid=11, ended=2.0, started=1.0)),     # the runner's truth
    (RUNNER_EXIT, 99, False, dict(returncode=-signal.SIGKILL, pid=None, ended=50.0)),  # an older run's file
    (None, 10, False, dict(returncode=-signal.SIGKILL, pid=None, ended=50.0)),         # runner killed with its group
    (None, 10, True, dict(returncode=0, pid=None, ended=50.0)),                        # an exit supervisord expected
])
def test_exit_record(runner_exit, runner_pid, expected_by_supervisord, want):
    ex = exit_record(runner_exit, runner_pid, expected_by_supervisord, INFLIGHT, "tail", now=50.0)
    assert {k: getattr(ex, k) for k in want} == want
    assert ex.runner_pid == runner_pid and ex.inflight == INFLIGHT and ex.stderr_tail == "tail"
