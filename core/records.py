"""Records that cross a process boundary, one frozen dataclass each.

Every file one mlxd process writes and another reads goes through one of
these, so a field has one name and one type on both sides:

  record            file (StatePaths)        writer            readers
  EnginePid         run/engine.pid           engine runner     listener, control
  EngineExit        run/engine.exit.json     engine runner     listener
  StandbyFile       run/standby.json         standby keeper    status, tests
  InflightRequest   run/engine.inflight.json engine worker     listener (every request in flight)
  CrashRecord       state/crashes.jsonl      listener          status, quarantine list, benchmarks
  Quarantine        state/quarantine.json    listener          engine, status
  SupervisionFile   state/supervision.json   listener          status, listener (on restart)
  StartedWith       run/started_with.json    mlxd up           status, down, logs, restart

`from_json` is forgiving by design: a missing file, a torn one, a record
from an older mlxd (unknown fields dropped, missing optional ones defaulted)
all read back as a record or as None -- never as an exception in the
supervision loop. `ExitRecord` is not a file: it is what the listener
gathers about one exit and hands to the restart policy in the exit event.
The reports that go over HTTP or to stdout (the engine's /health, `mlxd
status`) are Records too, in mlxd.reports.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from mlxd.paths import read_json, write_json_atomic

R = TypeVar("R", bound="Record")


class Record:
    """to_json/from_json for a frozen dataclass of JSON-able fields.

    `nested` maps a field name to the Record class its dict (or each dict of
    its list) reads back as. `json_names` maps a field name to its key in
    the JSON where the two differ (a Python keyword). `lenient`: a value of
    the wrong type reads as missing, so its default (a report from a host on
    another mlxd version must still read); file records leave types to
    their own checks."""

    nested: ClassVar[dict[str, type["Record"]]] = {}
    json_names: ClassVar[dict[str, str]] = {}
    lenient: ClassVar[bool] = False

    def to_json(self) -> dict[str, Any]:
        return {self.json_names.get(f.name, f.name): _json_value(getattr(self, f.name))
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls: type[R], data: Any) -> R | None:
        """The record, or None when `data` is not one (not a dict, or a
        required field missing). Unknown fields are ignored."""
        if not isinstance(data, dict):
            return None
        known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        keys = {cls.json_names.get(name, name): name for name in known}
        values = {keys[k]: v for k, v in data.items() if k in keys}
        for name, klass in cls.nested.items():
            if isinstance(values.get(name), list):
                values[name] = [r for r in map(klass.from_json, values[name]) if r is not None]
            elif name in values:
                values[name] = klass.from_json(values[name])
        if cls.lenient:
            hints = _field_types(cls)
            values = {k: v for k, v in values.items() if fits(v, hints[k])}
        for name, f in known.items():
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and values.get(name) is None:
                return None
        try:
            return cls(**values)
        except (TypeError, ValueError):
            return None

    @classmethod
    def read(cls: type[R], path: Path) -> R | None:
        return cls.from_json(read_json(path))

    def write(self, path: Path, durable: bool = True) -> None:
        write_json_atomic(path, self.to_json(), durable=durable)


def _json_value(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return value


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def fits(value: Any, hint: Any) -> bool:
    """Whether a value read from JSON has a field's type (pure): a union
    by any member, a list or dict with its items too, an int where a float
    goes, never a bool for a number."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(fits(k, args[0]) and fits(v, args[1]) for k, v in value.items())
    if hint in (int, float) and isinstance(value, bool):
        return False
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


@dataclass(frozen=True)
class EnginePid(Record):
    """The engine process the runner started (run/engine.pid)."""

    pid: int
    runner_pid: int
    started: float
    from_standby: bool = False  # the standby keeper's process took over (mlxd.standby); not the runner's child


@dataclass(frozen=True)
class StandbyFile(Record):
    """The standby keeper's one waiting engine process (run/standby.json):
    None while it has none; `ready` once its imports are done."""

    keeper_pid: int
    pid: int | None
    ready: bool
    import_s: float | None
    handovers: int
    updated: float


@dataclass(frozen=True)
class EngineExit(Record):
    """How the engine process ended, as its parent saw it (run/engine.exit.json).
    `returncode` is subprocess's: negative for a signal."""

    pid: int
    runner_pid: int
    returncode: int
    started: float
    ended: float


def request_pairs(requests: Any) -> tuple[tuple[str, str], ...]:
    """(request_id, fingerprint) of each well-formed entry of a `requests`
    list, in order; anything else (a foreign or torn value) is skipped."""
    if not isinstance(requests, list):
        return ()
    return tuple((r["request_id"], r["fingerprint"]) for r in requests
                 if isinstance(r, dict) and isinstance(r.get("request_id"), str)
                 and isinstance(r.get("fingerprint"), str))


@dataclass(frozen=True)
class InflightRequest(Record):
    """The requests the engine is generating for (run/engine.inflight.json),
    so that a crash can be blamed on them (quarantine) and journaled.

    `request_id`/`fingerprint` are the oldest request in flight (the only one
    when the engine generates one at a time); `requests` lists every request
    in flight, oldest first, each {"request_id": ..., "fingerprint": ...}.
    A file without `requests` (an older engine, or one request) reads as
    that single request: use `all_requests()`, never `requests` directly."""

    request_id: str
    fingerprint: str
    model: str
    pid: int
    started: float  # when the oldest request in flight started
    memory: dict[str, int] = field(default_factory=dict)
    requests: list[dict[str, str]] = field(default_factory=list)

    def all_requests(self) -> tuple[tuple[str, str], ...]:
        """((request_id, fingerprint), ...) of every request in flight, the
        oldest first; the record's own request leads even if `requests`
        left it out."""
        pairs = request_pairs(self.requests)
        own = (self.request_id, self.fingerprint)
        return pairs if own in pairs else (own, *pairs)


@dataclass(frozen=True)
class ExitRecord(Record):
    """Everything the listener knows about one engine exit; travels in the
    policy's EngineExited event and comes back in its RecordCrash action."""

    returncode: int
    ended: float
    pid: int | None = None
    runner_pid: int | None = None
    started: float | None = None
    stderr_tail: str = ""
    inflight: InflightRequest | None = None

    nested: ClassVar[dict[str, type[Record]]] = {"inflight": InflightRequest}

    @property
    def uptime_s(self) -> float | None:
        return round(self.ended - self.started, 3) if self.started is not None else None


@dataclass(frozen=True)
class CrashRecord(Record):
    """One line of the crash journal (state/crashes.jsonl): one engine exit."""

    time: float
    klass: str  # an ExitClass value; "class" in the file
    handled_at: float | None = None  # when the listener saw the exit
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    model: str | None = None
    uptime_s: float | None = None
    memory: dict[str, Any] | None = None
    request_id: str | None = None  # the oldest request in flight
    fingerprint: str | None = None
    stderr_tail: str = ""
    restart_in_s: float | None = None
    degraded: bool = False
    crash_report: str | None = None
    requests: list[dict[str, str]] = field(default_factory=list)  # every request in flight, oldest first

    json_names: ClassVar[dict[str, str]] = {"klass": "class"}

    @property
    def is_crash(self) -> bool:
        # backend_unsupported: a line the engine wrote while it served on (no exit: supervisor/exit_classes.py)
        return self.klass not in ("clean_stop", "backend_unsupported")

    def in_flight(self) -> tuple[tuple[str, str], ...]:
        """((request_id, fingerprint), ...) of every request in flight at this
        exit; a line from an older mlxd (no `requests`) gives its one."""
        pairs = request_pairs(self.requests)
        if pairs or not self.fingerprint:
            return pairs
        return ((self.request_id or "", self.fingerprint),)

    def fingerprints(self) -> frozenset[str]:
        return frozenset(fp for _, fp in self.in_flight() if fp)

    def to_line(self) -> bytes:
        return (json.dumps(self.to_json(), sort_keys=True, default=str) + "\n").encode()


@dataclass(frozen=True)
class Quarantine(Record):
    """Poison requests (state/quarantine.json): fingerprint -> refused until
    (epoch seconds), and suspects: requests in flight at a crash with others,
    decoded alone until then. The listener derives both from the journal
    (supervisor/journal.py, `quarantine_verdicts`); the engine refuses the one
    and serves the other alone."""

    fingerprints: dict[str, float] = field(default_factory=dict)
    suspects: dict[str, float] = field(default_factory=dict)

    def active(self, now: float) -> dict[str, float]:
        return {fp: until for fp, until in self.fingerprints.items() if until > now}


@dataclass(frozen=True)
class SupervisionFile(Record):
    """The listener's supervision state (state/supervision.json): the policy's
    State as JSON (flat, beside who wrote it), so a restarted listener
    resumes only a state of the same supervisord and status can show it."""

    state: dict[str, Any]  # supervisor.policy.State's fields; "mode" among them
    listener_pid: int
    updated: float
    supervisord_pid: int | None = None

    @property
    def mode(self) -> str | None:
        return self.state.get("mode")

    def to_json(self) -> dict[str, Any]:
        return {**self.state, "listener_pid": self.listener_pid, "updated": self.updated,
                "supervisord_pid": self.supervisord_pid}

    @classmethod
    def from_json(cls, data: Any) -> "SupervisionFile | None":
        if not isinstance(data, dict) or not isinstance(data.get("listener_pid"), int):
            return None
        extras = ("listener_pid", "updated", "supervisord_pid")
        return cls(state={k: v for k, v in data.items() if k not in extras}, listener_pid=data["listener_pid"],
                   updated=float(data.get("updated") or 0.0), supervisord_pid=data.get("supervisord_pid"))


@dataclass(frozen=True)
class StartedWith(Record):
    """What `mlxd up` started the stack with (run/started_with.json): the
    config file, the addresses it resolved from that file and its MLXD_*
    variables, and those variables themselves (`env`), so that status, down,
    logs and restart, run later from a shell without them, reach the same
    stack (mlxd.cli.started_with decides which value wins). `up_pid` is the
    `mlxd up` process that wrote it. A value of the wrong type (a hand-edited
    or foreign file) makes the whole record read as None."""

    config: str
    engine_host: str
    engine_port: int
    gateway_host: str
    gateway_port: int
    ollama_url: str
    env: dict[str, str] = field(default_factory=dict)
    up_pid: int | None = None
    started: float = 0.0

    def __post_init__(self) -> None:
        texts = (self.config, self.engine_host, self.gateway_host, self.ollama_url)
        ports = (self.engine_port, self.gateway_port)
        if not all(isinstance(t, str) for t in texts) or not all(
                isinstance(p, int) and not isinstance(p, bool) for p in ports):
            raise ValueError("StartedWith: a field of the wrong type")
        if not isinstance(self.env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("StartedWith: env must map names to strings")
