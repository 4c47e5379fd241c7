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

With `--standby` it first asks the standby keeper (supervisor/standby.py)
for its waiting engine process, whose imports are done: that process takes
this one's stdio, environment and arguments, and its exit status comes back
from the keeper, its parent. Without a standby ready it starts the engine
itself, as above.
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


class AdoptedEngine:
    """The standby keeper's process, as the runner drives it: by pid, its
    end reported by the keeper (the subprocess.Popen calls the runner uses)."""

    def __init__(self, pid: int, channel) -> None:
        self.pid = pid
        self.channel = channel
        self.returncode: int | None = None
        self._ended = threading.Event()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and threading.current_thread() is threading.main_thread() and timeout is None:
            from mlxd.standby import HandoverError

            try:
                message, _ = self.channel.recv()
                code = message.get("returncode")
                self.returncode = code if isinstance(code, int) else -signal.SIGKILL
            except (HandoverError, OSError):  # the keeper is gone: the engine must not outlive this runner
                self.kill()
                self.returncode = -signal.SIGKILL
            self._ended.set()
        elif not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired("engine", timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except OSError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _adopt_standby(paths: StatePaths, cmd: list[str]) -> AdoptedEngine | None:
    from .standby import request_handover

    pid, channel = request_handover(paths.standby_socket, cmd)
    if pid is None:
        print(f"mlxd-engine-runner: starting the engine afresh ({channel})", file=sys.stderr, flush=True)
        return None
    return AdoptedEngine(pid, channel)


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
    use_standby = args[:1] == ["--standby"]
    if use_standby:
        args = args[1:]
    if args[:1] == ["--rank-group"]:
        launcher, args = args[1:], []
    cmd = [*launcher, sys.executable, "-m", "mlxd.cli", "engine", *args]
    parent = os.getppid()
    started = time.time()
    child: subprocess.Popen | AdoptedEngine | None = None
    if use_standby and not launcher:
        child = _adopt_standby(paths, cmd)
    if child is None:
        # The engine exits with this runner (engine/main.py): killed by pid with supervisord, the runner can leave
        # no orphan holding the port and the memory. (A launcher's ranks watch the launcher instead.)
        env = os.environ if launcher else {**os.environ, "MLXD_EXIT_WITH_PARENT": str(os.getpid())}
        child = subprocess.Popen(cmd, stderr=subprocess.PIPE if launcher else None, env=env)
    rank_lines: list[str] = []
    relay = None
    if launcher:
        relay = threading.Thread(target=_relay, args=(child.stderr, sys.stderr.buffer, rank_lines), daemon=True)
        relay.start()
    EnginePid(pid=child.pid, runner_pid=os.getpid(), started=started,
              from_standby=isinstance(child, AdoptedEngine)).write(paths.engine_pid, durable=False)

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
