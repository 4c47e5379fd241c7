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
    (1, "RuntimeError: [METAL] Command buffer execution failed: Internal Error", ExitClass.MLX_ERROR),
    (-6, "libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command buffer "
         "execution failed: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
     ExitClass.METAL_OOM),
    (86, "RuntimeError: [metal::malloc] Attempting to allocate 40000000000 bytes which is greater than the "
         "maximum allowed buffer size", ExitClass.METAL_OOM),
    (-6, "Fatal Python error: Aborted", ExitClass.SIGABRT),
    (79, "", ExitClass.PRELOAD_FAILED),
    (78, "", ExitClass.CONFIG_ERROR),
    (1, "Traceback (most recent call last):\n  ValueError: x", ExitClass.PYTHON_EXCEPTION),
    (3, "", ExitClass.UNKNOWN),
])
def test_classify_exit(returncode, stderr, expected):
    assert classify_exit(returncode, stderr) is expected


@pytest.mark.parametrize("returncode, stderr, expected", [
    (-9, "", ExitClass.HANG),                    # our SIGKILL ended it: it was hung
    (137, "", ExitClass.HANG),                   # the same, through a wrapper
    (-6, "", ExitClass.SIGABRT),                 # it was dying of its own SIGABRT when the kill came (slow death)
    (-6, "[METAL] Command buffer execution failed: Insufficient Memory", ExitClass.METAL_OOM),
])
def test_a_kill_for_a_hang_is_a_hang_unless_the_process_died_of_its_own_signal_first(returncode, stderr, expected):
    assert classify_exit(returncode, stderr, killed_for_hang=True) is expected


def test_an_engine_killed_while_exiting_on_an_mlx_error_is_an_mlx_error():
    tail = "mlxd-engine: fatal MLX error (RuntimeError): [METAL] Command buffer execution failed: Internal Error"
    assert classify_exit(-9, tail, killed_for_hang=True) is ExitClass.MLX_ERROR
