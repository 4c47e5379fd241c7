"""The engine's runner: supervisord's `engine` program.

supervisord's events do not carry a child's exit status or signal, so this
small parent (stdlib only, starts in milliseconds) runs `mlxd engine`, waits
for it and writes the real status to run/engine.exit.json before exiting
with the same meaning (the code, or 128 + the signal). It also notices when
supervisord itself is gone (kill -9, crash) and stops the engine, so that no
orphan keeps the port and the GPU memory.

With `--rank-group LAUNCHER...` (a rank group, supervisor/rank_group.py) the
engine is started by MLX's launcher, once per rank; the launcher's stderr
passes through and says which rank ended how, and the status written is the
first rank's own failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlxd.paths import StatePaths
from mlxd.records import EngineExit, EnginePid

PARENT_POLL_S = 0.5
ORPHAN_STOP_GRACE_S = 5.0


def _watch_parent(child: subprocess.Popen, parent: int) -> None:
    while child.poll() is None:
        if os.getppid() != parent:  # reparented: supervisord died
            child.terminate()
            try:  # our stderr was a pipe to supervisord: it may be gone too
                print("mlxd-engine-runner: supervisord is gone; stopping the engine", file=sys.stderr, flush=True)
            except OSError:
                pass
            try:
                child.wait(ORPHAN_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
            return
        time.sleep(PARENT_POLL_S)


def _relay(stream, out, lines: list[str]) -> None:
    """Pass the launcher's stderr on, keeping the lines about ranks' exits."""
    for raw in iter(stream.readline, b""):
        out.write(raw)
        out.flush()
        if b"Node with rank" in raw:
            lines.append(raw.decode(errors="replace"))


def main() -> int:
    paths = StatePaths(Path(os.environ["MLXD_HOME"]))
    args = sys.argv[1:]
    launcher: list[str] = []
    if args[:1] == ["--rank-group"]:
        launcher, args = args[1:], []
    cmd = [*launcher, sys.executable, "-m", "mlxd.cli", "engine", *args]
    parent = os.getppid()
    started = time.time()
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE if launcher else None)
    rank_lines: list[str] = []
    relay = None
    if launcher:
        relay = threading.Thread(target=_relay, args=(child.stderr, sys.stderr.buffer, rank_lines), daemon=True)
        relay.start()
    EnginePid(pid=child.pid, runner_pid=os.getpid(), started=started).write(paths.engine_pid, durable=False)

    def forward(signum: int, _frame) -> None:
        if child.poll() is None:
            child.send_signal(signum)  # the engine drains on TERM; a repeat is harmless

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    threading.Thread(target=_watch_parent, args=(child, parent), daemon=True).start()
    returncode = child.wait()
    if relay is not None:
        from .rank_group import group_returncode

        relay.join(5)
        returncode = group_returncode(rank_lines, returncode)
    EngineExit(pid=child.pid, runner_pid=os.getpid(), returncode=returncode, started=started,
               ended=time.time()).write(paths.engine_exit)
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main())
