"""The crash listener: supervisord's event listener that owns engine restarts.

Two threads, one owner:
- the protocol thread speaks supervisord's listener protocol on stdin/stdout
  (supervisor.childutils.listener) and only forwards the engine's
  process-state events into a queue;
- the supervision thread owns the State: it turns queued events, /health
  polls, the clock and its own start-up into policy events (`policy.decide`
  makes every transition), and carries the actions out (start through
  supervisord's XML-RPC, kill for hangs, journal, quarantine list, state file).

A crash, followed through function arguments: supervisord's EXITED event ->
`exit_record` (the runner's EngineExit, the engine's InflightRequest, the
stderr tail) -> `EngineExited(t, exit)` -> `decide` -> `RecordCrash(exit, ...)`
and `StartEngine` -> `journal.crash_record` -> the journal line.
Logs go to stderr (stdout is the protocol channel).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

from mlxd.config import Config, load_config
from mlxd.keyfile import KeyFile
from mlxd.probe import get_json
from mlxd.records import CrashRecord, EngineExit, EnginePid, ExitRecord, InflightRequest, Quarantine, SupervisionFile
from mlxd.reports import EngineHealth

from . import journal
from .control import OPERATOR_RESTART
from .policy import (Action, EngineExited, EngineStarted, EngineStopped, Event, Health, KillEngine, Mode,
                     OperatorRestart, Policy, Reconciled, RecordCrash, StartEngine, State, Tick, decide)

log = logging.getLogger("mlxd.listener")
STDERR_TAIL_BYTES = 16_384
REPORT_WAIT_S = 5.0  # macOS writes its crash report a moment after the crash
LOOP_S = 0.05  # the supervision loop's step: bounds how late a crash is noticed


def health_event(url: str, now: float, headers: dict[str, str] | None = None) -> tuple[Health, EngineHealth | None]:
    """Poll /health once (with the engine's key): the policy's view and, when
    the answer was an engine's report, the report (never raises: see mlxd.probe)."""
    status, body = get_json(url, timeout=2.0, headers=headers)
    if status is None:
        return Health(now, ok=False), None
    report = EngineHealth.from_json(body)
    if status == 200 and isinstance(body, dict) and body:
        return Health(now, ok=True), report
    reported = report.status if report is not None else None
    return Health(now, ok=False, unhealthy=reported == "unhealthy",
                  loading=reported in ("loading", "draining", "exiting")), report


def exit_record(runner_exit: EngineExit | None, runner_pid: int, expected: bool, inflight: InflightRequest | None,
                stderr_tail: str, now: float) -> ExitRecord:
    """What we know of one exit (pure). The runner's record is the truth when
    it is this runner's; a runner killed with its group wrote none, and then
    supervisord's view of the runner is all there is."""
    if runner_exit is not None and runner_exit.runner_pid == runner_pid:
        return ExitRecord(returncode=runner_exit.returncode, ended=runner_exit.ended, pid=runner_exit.pid,
                          runner_pid=runner_pid, started=runner_exit.started, stderr_tail=stderr_tail,
                          inflight=inflight)
    return ExitRecord(returncode=0 if expected else -signal.SIGKILL, ended=now, runner_pid=runner_pid,
                      stderr_tail=stderr_tail, inflight=inflight)


class Supervision:
    def __init__(self, config: Config, rpc: Any) -> None:
        self.config = config
        self.paths = config.paths
        self.policy = Policy.from_config(config.supervisor)
        self.rpc = rpc
        self.events: queue.Queue[tuple[str, dict[str, str], float]] = queue.Queue()
        self.health_url = f"{config.engine_url}/health"
        self.engine_key = KeyFile(config.paths.engine_key)
        self.state = State()
        self.last_health: EngineHealth | None = None  # the engine's last report: a crash record's fallback facts
        self.stderr_offset = 0  # where this run's stderr starts in the log
        self.pending_records: list[tuple[float, CrashRecord]] = []  # waiting for a macOS crash report
        self.exit_file_mtime = self._exit_file_mtime()
        self.next_poll = 0.0  # when /health is polled next

    # --- the owner loop ------------------------------------------------------
    def run(self) -> None:
        self._reconcile()
        while True:
            try:
                item = self.events.get(timeout=LOOP_S)
            except queue.Empty:
                item = None
            try:
                self._step(item, time.time())
            except Exception:  # noqa: BLE001 - the supervisor must outlive any one bad step
                log.exception("supervision step failed; carrying on")
                time.sleep(LOOP_S)

    def _step(self, item: tuple[str, dict[str, str], float] | None, now: float) -> None:
        self._nudge_on_exit()
        if item is not None:
            event = self._policy_event(*item)
            if event is not None:
                self.apply(event)
        if now >= self.next_poll and self.state.mode is Mode.RUNNING:
            self.next_poll = now + self.config.supervisor.health_interval_s
            event, report = health_event(self.health_url, now, self.engine_key.headers())
            if report is not None:
                self.last_health = report
            self.apply(event)
        self.apply(Tick(now))
        self._flush_pending(now)

    def _exit_file_mtime(self) -> float | None:
        try:
            return self.paths.engine_exit.stat().st_mtime
        except OSError:
            return None

    def _nudge_on_exit(self) -> None:
        """supervisord reaps children only once per pass of its 1 s poll loop;
        the runner's exit file says at once that the engine is gone, and any
        XML-RPC call wakes supervisord to reap it and tell us."""
        mtime = self._exit_file_mtime()
        if mtime != self.exit_file_mtime:
            self.exit_file_mtime = mtime
            try:
                self.rpc.supervisor.getState()
            except Exception:  # noqa: BLE001 - only a wake-up call
                pass

    def apply(self, event: Event) -> None:
        new, actions = decide(self.state, event, self.policy)
        if new.mode is not self.state.mode:
            log.info("engine supervision: %s -> %s (%s)", self.state.mode.value, new.mode.value,
                     type(event).__name__)
        changed = new != self.state
        self.state = new
        for action in actions:
            self._execute(action)
        if changed:
            self._save()

    def _save(self) -> None:
        SupervisionFile(state=self.state.to_json(), listener_pid=os.getpid(), updated=time.time(),
                        supervisord_pid=self._supervisord_pid()).write(self.paths.supervision, durable=False)

    def _supervisord_pid(self) -> int | None:
        try:
            return int(self.rpc.supervisor.getPID())
        except Exception:  # noqa: BLE001 - supervisord may be going away
            return None

    # --- supervisord events --------------------------------------------------
    def _policy_event(self, eventname: str, headers: dict[str, str], t: float) -> Event | None:
        """supervisord's event -> the policy's event."""
        if eventname == "PROCESS_STATE_RUNNING":
            self.stderr_offset = self._stderr_size()
            return EngineStarted(t)
        if eventname in ("PROCESS_STATE_EXITED", "PROCESS_STATE_FATAL"):
            return EngineExited(t, self._collect_exit(headers, t))
        if eventname == "PROCESS_STATE_STOPPED":
            return EngineStopped(t)
        if eventname == "REMOTE_COMMUNICATION":
            return OperatorRestart(t)
        return None  # STARTING, STOPPING, BACKOFF: nothing to decide

    def _stderr_size(self) -> int:
        try:
            return self.paths.engine_stderr.stat().st_size
        except OSError:
            return 0

    def _stderr_tail(self) -> str:
        try:
            with self.paths.engine_stderr.open("rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = self.stderr_offset if self.stderr_offset <= size else 0
                f.seek(max(start, size - STDERR_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _collect_exit(self, headers: dict[str, str], t: float) -> ExitRecord:
        inflight = InflightRequest.read(self.paths.inflight)
        self.paths.inflight.unlink(missing_ok=True)  # the next run starts with no request in flight
        return exit_record(EngineExit.read(self.paths.engine_exit), int(headers.get("pid", 0) or 0),
                           headers.get("expected") != "0", inflight, self._stderr_tail(), t)

    # --- actions ---------------------------------------------------------------
    def _execute(self, action: Action) -> None:
        if isinstance(action, StartEngine):
            try:
                self.rpc.supervisor.startProcess("engine", False)
                log.info("starting the engine")
            except Exception as exc:  # noqa: BLE001 - e.g. ALREADY_STARTED
                log.warning("startProcess(engine): %s", exc)
        elif isinstance(action, KillEngine):
            self._kill_engine(action.reason)
        elif isinstance(action, RecordCrash):
            self._record_crash(action)

    def _kill_engine(self, reason: str) -> None:
        running = EnginePid.read(self.paths.engine_pid)
        log.warning("killing the engine (pid %s): %s", running.pid if running else None, reason)
        try:
            if running is not None:
                os.kill(running.pid, signal.SIGKILL)
            else:
                self.rpc.supervisor.signalProcess("engine", "KILL")
        except Exception as exc:  # noqa: BLE001 - it may have died meanwhile
            log.warning("kill failed: %s", exc)

    def _record_crash(self, action: RecordCrash) -> None:
        record = journal.crash_record(action, self.last_health, handled_at=time.time())
        log.warning("engine exited: %s (pid %s, code %s, signal %s, in flight %s); %s", record.klass, record.pid,
                    record.exit_code, record.signal, [rid for rid, _ in record.in_flight()] or "none",
                    "degraded" if action.degraded else f"restart in {action.restart_in_s:.1f}s")
        self.last_health = None
        if sys.platform == "darwin" and record.signal and record.pid:
            self.pending_records.append((time.time() + REPORT_WAIT_S, record))
            # The verdicts cannot wait for macOS's crash report: the engine restarts now, and the gateway sends the
            # requests it lost again at once -- a culprit alone at its second crash must be refused by then.
            self._write_verdicts()
        else:
            self._journal(record)

    def _flush_pending(self, now: float) -> None:
        still, done = [], []
        for deadline, record in self.pending_records:
            report = _find_crash_report(record.pid, record.time)
            if report is not None:
                done.append(journal.with_crash_report(record, *report))
            elif now >= deadline:
                done.append(record)
            else:
                still.append((deadline, record))
        self.pending_records = still  # before journaling: a record counts once in the verdicts
        for record in done:
            self._journal(record)

    def _journal(self, record: CrashRecord) -> None:
        journal.append_record(self.paths.journal, record, self.config.supervisor.journal_max_bytes)
        self._write_verdicts()

    def _write_verdicts(self) -> None:
        """The quarantine list (and the suspects), where it changed, from the
        journal's crashes and those still waiting for their crash report."""
        records = journal.read_records(self.paths.journal) + [r for _, r in self.pending_records]
        quarantined, suspects = journal.quarantine_verdicts(records, time.time(), self.config.supervisor.quarantine_s)
        current = Quarantine.read(self.paths.quarantine) or Quarantine()
        if quarantined != current.fingerprints or suspects != current.suspects:
            if quarantined != current.fingerprints:
                log.warning("quarantined requests: %s", sorted(quarantined))
            if suspects != current.suspects:
                log.info("requests decoded alone (in flight at a crash with others): %s", sorted(suspects))
            Quarantine(quarantined, suspects).write(self.paths.quarantine)

    # --- start-up ----------------------------------------------------------------
    def _reconcile(self) -> None:
        """After a (re)start of the listener: resume from the saved state if
        it belongs to this supervisord, then let the policy match it to the
        engine's real state."""
        saved = SupervisionFile.read(self.paths.supervision)
        if saved is not None and saved.supervisord_pid == self._supervisord_pid():
            try:
                self.state = State.from_json(saved.state)
            except (TypeError, ValueError):
                self.state = State()
        try:
            info = self.rpc.supervisor.getProcessInfo("engine")
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot read the engine's state: %s", exc)
            return
        statename = str(info.get("statename"))
        now = time.time()
        if statename == "RUNNING":
            self.stderr_offset = self._stderr_size()
        self.apply(Reconciled(now, statename, float(info.get("start") or now)))
        self._save()
        log.info("crash listener ready (engine %s, supervision %s)", statename, self.state.mode.value)


def _find_crash_report(pid: int | None, died_at: float) -> tuple[str, bool] | None:
    """(a one-line summary, whether it shows a Metal OOM) of macOS's report."""
    from .crash_reports import default_reports_dir, find_report, is_metal_oom, summary

    found = find_report(default_reports_dir(), pid, died_at) if pid else None
    return (f"{found[0].name}: {summary(found[1])}", is_metal_oom(found[1])) if found else None


def serve_protocol(stdin, stdout, supervision: Supervision) -> None:
    """supervisord's listener protocol; returns when supervisord goes away."""
    from supervisor import childutils

    while True:
        try:
            headers, payload = childutils.listener.wait(stdin, stdout)
        except (ValueError, KeyError):  # stdin closed: supervisord is gone, so are we
            return
        eventname = headers.get("eventname", "")
        if eventname.startswith("PROCESS_STATE"):
            pheaders, _ = childutils.eventdata(payload + "\n")
            if pheaders.get("processname") == "engine":
                supervision.events.put((eventname, pheaders, time.time()))
        elif eventname == "REMOTE_COMMUNICATION":
            pheaders, data = childutils.eventdata(payload)
            if (pheaders.get("type"), data) == OPERATOR_RESTART:
                supervision.events.put((eventname, pheaders, time.time()))
        childutils.listener.ok(stdout)


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from supervisor import childutils

    config = load_config()
    supervision = Supervision(config, childutils.getRPCInterface(os.environ))
    threading.Thread(target=supervision.run, name="supervision", daemon=True).start()
    serve_protocol(sys.stdin, sys.stdout, supervision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
