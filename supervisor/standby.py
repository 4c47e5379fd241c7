"""The standby keeper: supervisord's `standby` program (mlxd.standby says why).

It keeps one engine process waiting with its Python imported and no model
(`python -m mlxd.cli.standby`), hands it to the engine's runner when
supervisord starts one, and is its parent from then on: it reports the
process's exit status to the runner, and kills the process if the runner
disappears first (killed with its process group by supervisord), so no
engine outlives its runner.

A new standby is started `delay_s` after the last handover (or the keeper's
start), not at once: its imports would compete with the engine's own start
for the CPU. One that dies before it is ready (a broken install) backs the
next try off, doubling up to STANDBY_BACKOFF_CAP_S. `discard` (sent by `mlxd
restart`) replaces the waiting process, so an operator's restart picks up new
code and config the way a fresh start does; a crash's restart uses the
standby.

Stdlib only, besides mlxd's own records.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mlxd.paths import StatePaths
from mlxd.records import StandbyFile
from mlxd.standby import Channel, HandoverError, close_all

log = logging.getLogger("mlxd.standby")

STANDBY_DELAY_S = 10.0
STANDBY_BACKOFF_CAP_S = 300.0
CONNECT_TIMEOUT_S = 2.0
REPLY_TIMEOUT_S = 5.0
LOOP_S = 0.5


# --- decisions (pure) -----------------------------------------------------------
def standby_wait(delay_s: float, failures: int) -> float:
    """Seconds from the last handover, discard or failure to the next standby:
    `delay_s`, doubled for each standby that died before it was ready, capped."""
    return min(delay_s * 2 ** failures, max(delay_s, STANDBY_BACKOFF_CAP_S)) if failures else delay_s


def standby_due(*, has_standby: bool, now: float, quiet_since: float, delay_s: float, failures: int) -> bool:
    """Whether to start a standby now: none waiting, and standby_wait since the last handover, discard or failure."""
    return not has_standby and now - quiet_since >= standby_wait(delay_s, failures)


def handover_message(argv: list[str], env: dict[str, str], cwd: str) -> dict:
    return {"op": "handover", "argv": list(argv), "env": dict(env), "cwd": cwd}


def go_message(handover: dict) -> dict | None:
    """The `go` a standby gets for a runner's handover, or None when the
    handover is malformed (the runner then starts the engine itself)."""
    argv, env, cwd = handover.get("argv"), handover.get("env"), handover.get("cwd")
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        return None
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        return None
    if not isinstance(cwd, str):
        return None
    return {"op": "go", "argv": argv, "env": env, "cwd": cwd}


# --- the keeper ------------------------------------------------------------------
@dataclass
class Standby:
    proc: subprocess.Popen
    channel: Channel
    ready: bool = False
    import_s: float | None = None


class Keeper:
    def __init__(self, paths: StatePaths, delay_s: float) -> None:
        self.paths = paths
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.save_lock = threading.Lock()
        self.standby: Standby | None = None  # owned by the main loop; handovers take it under the lock
        self.quiet_since = time.monotonic()
        self.failures = 0
        self.handovers = 0
        self.stopping = False
        self.listener = _listen(paths.standby_socket)

    # --- the main loop: the standby's life ------------------------------------
    def run(self) -> None:
        parent = os.getppid()
        while not self.stopping:
            if os.getppid() != parent:  # reparented: supervisord is gone
                log.warning("supervisord is gone; stopping")
                break
            self._maybe_spawn()
            with self.lock:
                standby = self.standby
            waiting = [self.listener] + ([standby.channel.sock] if standby and not standby.ready else [])
            try:
                readable, _, _ = select.select(waiting, [], [], LOOP_S)
            except InterruptedError:
                continue
            if self.listener in readable:
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    continue
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
            if standby is not None and standby.channel.sock in readable:
                self._standby_said(standby)
            self._reap_failed()
        self.close()

    def _maybe_spawn(self) -> None:
        with self.lock:
            due = standby_due(has_standby=self.standby is not None, now=time.monotonic(),
                              quiet_since=self.quiet_since, delay_s=self.delay_s, failures=self.failures)
            if not due:
                return
            ours, theirs = socket.socketpair()
            try:
                proc = subprocess.Popen([sys.executable, "-m", "mlxd.cli.standby", str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        start_new_session=True)  # its own group: a stop of ours is not its
            finally:
                theirs.close()
            self.standby = Standby(proc, Channel(ours))
            log.info("standby engine %d starting", proc.pid)
        self._save()

    def _standby_said(self, standby: Standby) -> None:
        try:
            message, fds = standby.channel.recv()
        except HandoverError:
            return  # it died: _reap_failed sees it
        close_all(fds)
        if message.get("ready"):
            standby.ready = True
            import_s = message.get("import_s")
            standby.import_s = import_s if isinstance(import_s, (int, float)) else None
            log.info("standby engine %d ready (imports %.2f s)", standby.proc.pid, standby.import_s or 0.0)
            with self.lock:
                self.failures = 0
            self._save()

    def _reap_failed(self) -> None:
        with self.lock:
            standby = self.standby
            if standby is None or standby.proc.poll() is None:
                return
            self.standby = None
            self.failures += 1
            self.quiet_since = time.monotonic()
        standby.channel.close()
        log.warning("standby engine %d exited with %s before it was used; the next one in %.0f s",
                    standby.proc.pid, standby.proc.returncode, standby_wait(self.delay_s, self.failures))
        self._save()

    def _take_ready(self) -> Standby | None:
        with self.lock:
            standby = self.standby
            if standby is None or not standby.ready or standby.proc.poll() is not None:
                return None
            self.standby = None
            self.quiet_since = time.monotonic()
            self.handovers += 1
            return standby

    def _discard(self) -> None:
        with self.lock:
            standby, self.standby = self.standby, None
            self.quiet_since = time.monotonic()
        if standby is not None:
            _kill(standby.proc)
            standby.channel.close()
            log.info("standby engine %d discarded", standby.proc.pid)
        self._save()

    # --- a connection: a runner's handover, or a discard ------------------------
    def _serve(self, conn: socket.socket) -> None:
        channel = Channel(conn)
        try:
            conn.settimeout(REPLY_TIMEOUT_S)
            message, fds = channel.recv()
            conn.settimeout(None)
            if message.get("op") == "discard":
                close_all(fds)
                self._discard()
                channel.send({"ok": True})
                return
            go = go_message(message) if message.get("op") == "handover" else None
            standby = self._take_ready() if go is not None and len(fds) == 3 else None
            if standby is None:
                close_all(fds)
                channel.send({"pid": None, "reason": "no standby engine ready" if go else "bad handover"})
                return
            try:
                standby.channel.send(go, fds)
            except OSError as exc:  # it died this very moment: the runner starts one itself
                _kill(standby.proc)
                channel.send({"pid": None, "reason": f"the standby engine is gone: {exc}"})
                return
            finally:
                close_all(fds)
                standby.channel.close()
            try:
                channel.send({"pid": standby.proc.pid})
            except OSError:  # the runner went away in between: its engine must not run without it
                _kill(standby.proc)
                raise
            log.info("standby engine %d handed to runner (%s)", standby.proc.pid, " ".join(go["argv"][-3:]))
            self._save()
            self._watch(standby.proc, channel)
        except (HandoverError, OSError) as exc:
            log.warning("handover connection: %s", exc)
        finally:
            channel.close()

    def _watch(self, proc: subprocess.Popen, runner: Channel) -> None:
        """Report the engine's end to its runner; kill it if the runner goes first."""

        def report() -> None:
            code = proc.wait()
            try:
                runner.send({"returncode": code})
            except OSError:
                pass

        reporter = threading.Thread(target=report, daemon=True)
        reporter.start()
        try:
            runner.recv()  # the runner sends nothing more: this returns at its end
        except (HandoverError, OSError):
            pass
        if proc.poll() is None:
            log.warning("engine %d's runner is gone; killing the engine", proc.pid)
            _kill(proc)
        reporter.join(5)

    # --- its state file and its end ---------------------------------------------
    def _save(self) -> None:
        """run/standby.json for `mlxd status`; never fails a handover."""
        with self.save_lock:  # the main loop and handovers both save: one writer at a time, the latest state
            with self.lock:
                standby = self.standby
                record = StandbyFile(keeper_pid=os.getpid(), pid=standby.proc.pid if standby else None,
                                     ready=bool(standby and standby.ready),
                                     import_s=standby.import_s if standby else None,
                                     handovers=self.handovers, updated=time.time())
            try:
                record.write(self.paths.standby, durable=False)
            except OSError as exc:
                log.warning("could not write %s: %s", self.paths.standby, exc)

    def close(self) -> None:
        with self.lock:
            standby, self.standby = self.standby, None
        if standby is not None:
            _kill(standby.proc)
            standby.channel.close()
        self.listener.close()
        self.paths.standby_socket.unlink(missing_ok=True)
        self.paths.standby.unlink(missing_ok=True)


def _listen(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)  # a stale one from a keeper that was killed
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)  # only our user may hand stdio to the engine
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(8)
    return sock


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.kill()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass


# --- the clients: the runner and `mlxd restart` ------------------------------------
def request_handover(path: Path, argv: list[str]) -> tuple[int, Channel] | tuple[None, str]:
    """Ask the keeper for its standby to become the engine with this
    process's stdio, environment, working directory and `argv`. Returns
    (pid, channel) -- `channel.recv()` then brings {"returncode": N} at the
    engine's end -- or (None, why not)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    channel = Channel(sock)
    try:
        sock.connect(str(path))
        channel.send(handover_message(argv, dict(os.environ), os.getcwd()), [0, 1, 2])
        sock.settimeout(REPLY_TIMEOUT_S)
        reply, fds = channel.recv()
        close_all(fds)
    except (OSError, HandoverError) as exc:
        channel.close()
        return None, f"no standby keeper: {exc}"
    pid = reply.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        channel.close()
        return None, str(reply.get("reason") or "refused")
    sock.settimeout(None)
    return pid, channel


def discard_standby(path: Path) -> bool:
    """Have the keeper replace its waiting process (after an upgrade or a
    config change, the next engine must import afresh). False if no keeper
    answered."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(REPLY_TIMEOUT_S)
    channel = Channel(sock)
    try:
        sock.connect(str(path))
        channel.send({"op": "discard"})
        reply, _ = channel.recv()
        return bool(reply.get("ok"))
    except (OSError, HandoverError):
        return False
    finally:
        channel.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="mlxd-standby")
    parser.add_argument("--delay", type=float, default=STANDBY_DELAY_S,
                        help="seconds after a handover before the next standby engine is started")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keeper = Keeper(StatePaths(Path(os.environ["MLXD_HOME"])), args.delay)

    def stop(_signum: int, _frame) -> None:
        keeper.stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    keeper.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
