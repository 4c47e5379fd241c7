"""Crash classification: what an engine exit means (pure).

The engine's exit status says a lot (a signal, or one of mlxd's exit codes),
and the tail of its stderr says the rest: MLX's Metal messages survive in it
even when the process died by SIGABRT. The crash listener feeds this with
what the engine runner and the engine's log give it.
"""

from __future__ import annotations

import enum
import re
import signal

from mlxd import exit_codes


class ExitClass(enum.Enum):
    CLEAN_STOP = "clean_stop"
    SIGABRT = "sigabrt"  # Metal's check_error aborts the process
    SIGKILL = "sigkill"  # e.g. the OS killing it for memory
    OTHER_SIGNAL = "other_signal"
    MLX_ERROR = "mlx_error"  # MLX raised; the engine exited on purpose to restart clean
    METAL_OOM = "metal_oom"  # Metal ran out of memory (its message is in stderr)
    HANG = "hang"  # alive but not serving: we killed it
    PRELOAD_FAILED = "preload_failed"
    CONFIG_ERROR = "config_error"
    PYTHON_EXCEPTION = "python_exception"
    UNKNOWN = "unknown"
    # Not an exit: the engine met an op or dtype its MLX backend cannot run, answered the requests and reloaded
    # the model as float32 (engine/model/errors.py, backend_limit); it journals this line itself.
    BACKEND_UNSUPPORTED = "backend_unsupported"


NOT_EXITS = frozenset({ExitClass.BACKEND_UNSUPPORTED.value})  # journal lines the engine wrote while it served on


METAL_PATTERNS = (
    r"\[METAL\] Command buffer execution failed",
    r"Insufficient Memory",
    r"kIOGPUCommandBufferCallbackErrorOutOfMemory",
    r"check_error",
    r"\[metal::malloc\]",
)
_METAL = re.compile("|".join(METAL_PATTERNS))


_METAL_OOM = re.compile(r"Insufficient Memory|OutOfMemory|\[metal::malloc\]|out of memory", re.IGNORECASE)


def mentions_metal_error(stderr_tail: str) -> bool:
    return bool(_METAL.search(stderr_tail))


def exit_signal(returncode: int) -> int | None:
    """The signal that ended the process: negative returncodes (subprocess)
    or 128+N (a wrapper or shell)."""
    if returncode < 0:
        return -returncode
    return returncode - 128 if 128 < returncode < 160 else None


def signal_name(sig: int | None) -> str | None:
    if sig is None:
        return None
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"


def classify_exit(returncode: int, stderr_tail: str = "", killed_for_hang: bool = False) -> ExitClass:
    """What an engine exit means, from its status and its stderr's tail."""
    sig = exit_signal(returncode)
    # A process that died of its own signal before our kill landed (a SIGABRT whose process takes seconds to go:
    # a CUDA context torn down, a macOS crash report written, /health refused meanwhile) is its crash, not a hang.
    if killed_for_hang and sig in (None, signal.SIGKILL):
        if "fatal MLX error" not in stderr_tail:
            return ExitClass.HANG
        # Killed while it was exiting on an MLX error: the error is the story.
        return ExitClass.METAL_OOM if _METAL_OOM.search(stderr_tail) else ExitClass.MLX_ERROR
    if sig != signal.SIGKILL and _METAL_OOM.search(stderr_tail) and mentions_metal_error(stderr_tail):
        return ExitClass.METAL_OOM
    if sig == signal.SIGABRT:
        return ExitClass.SIGABRT
    if sig == signal.SIGKILL:
        return ExitClass.SIGKILL
    if sig in (signal.SIGTERM, signal.SIGINT) or returncode == exit_codes.OK:
        return ExitClass.CLEAN_STOP
    if sig is not None:
        return ExitClass.OTHER_SIGNAL
    if returncode == exit_codes.MLX_ERROR or mentions_metal_error(stderr_tail):
        return ExitClass.MLX_ERROR
    if returncode == exit_codes.PRELOAD_FAILED:
        return ExitClass.PRELOAD_FAILED
    if returncode == exit_codes.CONFIG:
        return ExitClass.CONFIG_ERROR
    if "Traceback (most recent call last)" in stderr_tail:
        return ExitClass.PYTHON_EXCEPTION
    return ExitClass.UNKNOWN
