"""The crash listener: supervisord's event listener that owns engine restarts.

Two threads, one owner:
- the protocol thread speaks supervisord's listener protocol on
  stdin/stdout (READY, event, RESULT) and only forwards the engine's
  process-state events into a queue;
- the supervision thread owns the State: it turns queued events, /health
  polls and the clock into policy events, runs `policy.decide`, and carries
  the actions out (start through supervisord's XML-RPC, kill for hangs,
  journal, quarantine list, state file).
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
from dataclasses import asdict, replace
from typing import Any

from mlxd.config import Config, load_config
from mlxd.paths import StatePaths, read_json, write_json_atomic
from mlxd.probe import get_json

from . import journal
from .exit_classes import classify_exit, exit_signal
from .policy import (EngineExited, EngineStarted, Health, KillEngine, Mode, OperatorStop, Policy, RecordCrash,
                     StartEngine, State, Tick, decide)

log = logging.getLogger("mlxd.listener")
STDERR_TAIL_BYTES = 16_384
REPORT_WAIT_S = 5.0  # macOS writes its crash report a moment after the crash
LOOP_S = 0.05  # the supervision loop's step: bounds how late a crash is noticed


def policy_from_config(config: Config) -> Policy:
    s = config.supervisor
    return Policy(backoff_base_s=s.backoff_base_s, backoff_cap_s=s.backoff_cap_s, healthy_reset_s=s.healthy_reset_s,
                  loop_crashes=s.loop_crashes, loop_window_s=s.loop_window_s, cooldown_s=s.cooldown_s,
                  health_failures=s.health_failures, start_grace_s=s.start_grace_s)


def state_to_json(state: State) -> dict[str, Any]:
    d = asdict(state)
    d["mode"] = state.mode.value
    d["crash_times"] = list(state.crash_times)
    return d


def state_from_json(d: dict[str, Any]) -> State:
    fields = {k: d[k] for k in State.__dataclass_fields__ if k in d}
    fields["mode"] = Mode(fields.get("mode", "starting"))
    fields["crash_times"] = tuple(fields.get("crash_times", ()))
    return State(**fields)


def health_event(url: str, now: float) -> tuple[Health, dict | None]:
    """Poll /health once: the policy's view and, when it answered, the body
    (never raises: see mlxd.probe)."""
    status, body = get_json(url, timeout=2.0)
    if status is None:
        return Health(now, ok=False), None
    body = body if isinstance(body, dict) else {}
    if status == 200 and body:
        return Health(now, ok=True), body
    reported = body.get("status")
    return Health(now, ok=False, unhealthy=reported == "unhealthy",
                  loading=reported in ("loading", "draining", "exiting")), body


class Supervision:
    def __init__(self, config: Config, rpc: Any) -> None:
        self.config = config
        self.paths = StatePaths(config.home)
        self.policy = policy_from_config(config)
        self.rpc = rpc
        self.events: queue.Queue[tuple[str, dict[str, str], float]] = queue.Queue()
        host = config.engine.host if config.engine.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.health_url = f"http://{host}:{config.engine.port}/health"
        self.state = State()
        self.last_health: dict | None = None
        self.stderr_offset = 0
        self.exit_info: dict[str, Any] = {}
        self.pending_records: list[tuple[float, dict[str, Any]]] = []  # waiting for a macOS crash report
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
            self._on_process_event(*item)
        if now >= self.next_poll and self.state.mode is Mode.RUNNING:
            self.next_poll = now + self.config.supervisor.health_interval_s
            event, body = health_event(self.health_url, now)
            if body and body.get("status"):
                self.last_health = body
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

    def apply(self, event: Any) -> None:
        new, actions = decide(self.state, event, self.policy)
        for action in actions:
            self._execute(action, event)
        if new != self.state:
            if new.mode is not self.state.mode:
                log.info("engine supervision: %s -> %s", self.state.mode.value, new.mode.value)
            self.state = new
            self._save()

    def _save(self) -> None:
        data = state_to_json(self.state)
        data.update(listener_pid=os.getpid(), updated=time.time(), supervisord_pid=self._supervisord_pid())
        write_json_atomic(self.paths.supervision, data, durable=False)

    def _supervisord_pid(self) -> int | None:
        try:
            return int(self.rpc.supervisor.getPID())
        except Exception:  # noqa: BLE001 - supervisord may be going away
            return None

    # --- supervisord events --------------------------------------------------
    def _on_process_event(self, eventname: str, headers: dict[str, str], t: float) -> None:
        if eventname == "PROCESS_STATE_RUNNING":
            if self.state.mode is not Mode.STARTING:
                # Started by an operator (mlxd restart / supervisorctl): a fresh slate.
                log.info("engine started by an operator; crash history cleared")
                self.state = State(mode=Mode.STARTING)
            self.stderr_offset = self._stderr_size()
            self.apply(EngineStarted(t))
        elif eventname == "PROCESS_STATE_EXITED":
            self.exit_info = self._collect_exit(headers, t)
            self.apply(EngineExited(t, crash=True))
        elif eventname == "PROCESS_STATE_STOPPED":
            self.apply(OperatorStop(t))
        elif eventname == "PROCESS_STATE_FATAL":
            self.exit_info = self._collect_exit(headers, t)
            self.apply(EngineExited(t, crash=True))

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

    def _collect_exit(self, headers: dict[str, str], t: float) -> dict[str, Any]:
        exit_rec = read_json(self.paths.engine_exit) or {}
        runner_pid = int(headers.get("pid", 0) or 0)
        if exit_rec.get("runner_pid") != runner_pid:
            exit_rec = {}  # the runner itself died before writing it (killed with its group)
        inflight = read_json(self.paths.inflight) or {}
        self.paths.inflight.unlink(missing_ok=True)
        returncode = exit_rec.get("returncode")
        if returncode is None:  # fall back on what supervisord saw of the runner
            returncode = -9 if headers.get("expected") == "0" else 0
        return {"returncode": returncode, "pid": exit_rec.get("pid"), "runner_pid": runner_pid,
                "started": exit_rec.get("started"), "ended": exit_rec.get("ended", t),
                "stderr_tail": self._stderr_tail(), "inflight": inflight}

    # --- actions ---------------------------------------------------------------
    def _execute(self, action: Any, event: Any) -> None:
        if isinstance(action, StartEngine):
            try:
                self.rpc.supervisor.startProcess("engine", False)
                log.info("starting the engine")
            except Exception as exc:  # noqa: BLE001 - e.g. ALREADY_STARTED
                log.warning("startProcess(engine): %s", exc)
        elif isinstance(action, KillEngine):
            self._kill_engine(action.reason)
        elif isinstance(action, RecordCrash):
            self._record_crash(action, event)

    def _kill_engine(self, reason: str) -> None:
        pid = (read_json(self.paths.engine_pid) or {}).get("pid")
        log.warning("killing the engine (pid %s): %s", pid, reason)
        try:
            if pid:
                os.kill(int(pid), signal.SIGKILL)
            else:
                self.rpc.supervisor.signalProcess("engine", "KILL")
        except (OSError, Exception) as exc:  # noqa: BLE001 - it may have died meanwhile
            log.warning("kill failed: %s", exc)

    def _record_crash(self, action: RecordCrash, event: Any) -> None:
        info = self.exit_info
        rc = int(info.get("returncode", 0))
        tail = info.get("stderr_tail", "")
        klass = classify_exit(rc, tail, killed_for_hang=action.killed_for == "hang")
        health = self.last_health or {}
        inflight = info.get("inflight") or {}
        started = info.get("started")
        record = {
            "time": info.get("ended") or time.time(),
            "handled_at": time.time(),  # when the listener saw the exit
            "class": klass.value,
            "pid": info.get("pid"),
            "exit_code": rc if rc >= 0 and exit_signal(rc) is None else None,
            "signal": _signal_name(exit_signal(rc)),
            "model": inflight.get("model") or health.get("resident_model"),
            "uptime_s": round(info["ended"] - started, 3) if started and info.get("ended") else None,
            "memory": inflight.get("memory") or health.get("memory"),
            "request_id": inflight.get("request_id"),
            "fingerprint": inflight.get("fingerprint"),
            "stderr_tail": "\n".join(tail.strip().splitlines()[-12:])[-2000:],
            "restart_in_s": action.restart_in_s,
            "degraded": action.degraded,
            "crash_report": None,
        }
        log.warning("engine exited: %s (pid %s, code %s, signal %s); %s", record["class"], record["pid"],
                    record["exit_code"], record["signal"],
                    "degraded" if action.degraded else f"restart in {action.restart_in_s:.1f}s")
        self.last_health = None
        if sys.platform == "darwin" and record["signal"] and record["pid"]:
            self.pending_records.append((time.time() + REPORT_WAIT_S, record))
        else:
            self._journal(record)

    def _flush_pending(self, now: float) -> None:
        still = []
        for deadline, record in self.pending_records:
            report = _find_crash_report(record["pid"], record["time"])
            if report is not None or now >= deadline:
                if report is not None:
                    record["crash_report"], oom = report
                    if oom and record["class"] in ("sigabrt", "mlx_error"):
                        record["class"] = "metal_oom"
                self._journal(record)
            else:
                still.append((deadline, record))
        self.pending_records = still

    def _journal(self, record: dict[str, Any]) -> None:
        journal.append_record(self.paths.journal, record, self.config.supervisor.journal_max_bytes)
        records = journal.read_records(self.paths.journal)
        quarantined = journal.quarantine_list(records, time.time(), self.config.supervisor.quarantine_s)
        current = (read_json(self.paths.quarantine) or {}).get("fingerprints", {})
        if quarantined != current:
            log.warning("quarantined requests: %s", sorted(quarantined))
            write_json_atomic(self.paths.quarantine, {"fingerprints": quarantined})

    # --- start-up ----------------------------------------------------------------
    def _reconcile(self) -> None:
        """After a (re)start of the listener: resume from the saved state if
        it belongs to this supervisord, and match the engine's real state."""
        saved = read_json(self.paths.supervision) or {}
        if saved and saved.get("supervisord_pid") == self._supervisord_pid():
            try:
                self.state = state_from_json(saved)
            except (TypeError, ValueError):
                self.state = State()
        try:
            info = self.rpc.supervisor.getProcessInfo("engine")
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot read the engine's state: %s", exc)
            return
        statename = info.get("statename")
        now = time.time()
        if statename == "RUNNING":
            self.state = replace(self.state, mode=Mode.RUNNING, started_at=float(info.get("start") or now))
            self.stderr_offset = self._stderr_size()
        elif statename in ("EXITED", "FATAL", "BACKOFF") and self.state.mode not in (Mode.DEGRADED, Mode.BACKOFF):
            self.state = replace(self.state, mode=Mode.BACKOFF, restart_at=now)
        elif statename == "STOPPED" and self.state.mode is not Mode.STOPPED:
            self.state = replace(self.state, mode=Mode.STOPPED)
        self._save()
        log.info("crash listener ready (engine %s, supervision %s)", statename, self.state.mode.value)


def _signal_name(sig: int | None) -> str | None:
    if sig is None:
        return None
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"


def _find_crash_report(pid: int, died_at: float) -> tuple[str, bool] | None:
    """(a one-line summary, whether it shows a Metal OOM) of macOS's report."""
    from .crash_reports import default_reports_dir, find_report, is_metal_oom, summary

    found = find_report(default_reports_dir(), pid, died_at)
    return (f"{found[0].name}: {summary(found[1])}", is_metal_oom(found[1])) if found else None


def serve_protocol(stdin, stdout, supervision: Supervision) -> None:
    """supervisord's listener protocol; returns when supervisord goes away."""
    from supervisor import childutils

    while True:
        stdout.write("READY\n")
        stdout.flush()
        line = stdin.readline()
        if not line:
            return  # supervisord is gone: so are we
        headers = childutils.get_headers(line)
        payload = stdin.read(int(headers["len"]))
        eventname = headers.get("eventname", "")
        if eventname.startswith("PROCESS_STATE"):
            pheaders, _ = childutils.eventdata(payload + "\n")
            if pheaders.get("processname") == "engine":
                supervision.events.put((eventname, pheaders, time.time()))
        stdout.write("RESULT 2\nOK")
        stdout.flush()


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
