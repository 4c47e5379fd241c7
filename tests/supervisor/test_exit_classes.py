import pytest

from mlxd.supervisor.exit_classes import ExitClass, classify_exit


@pytest.mark.parametrize("returncode, stderr, expected", [
    (0, "", ExitClass.CLEAN_STOP),
    (-15, "", ExitClass.CLEAN_STOP),
    (-6, "", ExitClass.SIGABRT),
    (134, "", ExitClass.SIGABRT),                    # 128 + SIGABRT from a wrapper
    (-9, "", ExitClass.SIGKILL),
    (137, "", ExitClass.SIGKILL),
    (-11, "", ExitClass.OTHER_SIGNAL),
    (86, "", ExitClass.MLX_ERROR),
    (1, "RuntimeError: [METAL] Command buffer execution failed: Insufficient Memory", ExitClass.MLX_ERROR),
    (79, "", ExitClass.PRELOAD_FAILED),
    (78, "", ExitClass.CONFIG_ERROR),
    (1, "Traceback (most recent call last):\n  ValueError: x", ExitClass.PYTHON_EXCEPTION),
    (3, "", ExitClass.UNKNOWN),
])
def test_classify_exit(returncode, stderr, expected):
    assert classify_exit(returncode, stderr) is expected
