"""Where mlxd keeps its state: one directory ($MLXD_HOME), one layout.

  mlxd.toml                      the config (the single source of truth)
  key                            the gateway key (0600)
  engine.key                     the engine's key, where engine.require_key (0600)
  run/   supervisord.sock, supervisord.pid, engine.pid, engine.exit.json,
         engine.inflight.json    (live process state; stale after a crash),
         started_with.json       (what `mlxd up` started with; `mlxd down` removes it)
  logs/  supervisord.log, engine.log, engine.err.log, listener.log
  state/ crashes.jsonl, quarantine.json, supervision.json,
         kv/ (the prompt cache's disk tier: one safetensors file per entry)
  generated/ supervisord.conf    (generated from mlxd.toml, never edited)
  models/ demo-a, demo-b          (built-in demo models)
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StatePaths:
    home: Path

    @property
    def key(self) -> Path:
        return self.home / "key"

    @property
    def engine_key(self) -> Path:
        return self.home / "engine.key"

    @property
    def litellm_config(self) -> Path:
        return self.generated / "litellm.yaml"

    @property
    def run(self) -> Path:
        return self.home / "run"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def state(self) -> Path:
        return self.home / "state"

    @property
    def generated(self) -> Path:
        return self.home / "generated"

    @property
    def socket(self) -> Path:
        return self.run / "supervisord.sock"

    @property
    def supervisord_pid(self) -> Path:
        return self.run / "supervisord.pid"

    @property
    def supervisord_conf(self) -> Path:
        return self.generated / "supervisord.conf"

    @property
    def engine_pid(self) -> Path:
        return self.run / "engine.pid"

    @property
    def engine_exit(self) -> Path:
        return self.run / "engine.exit.json"

    @property
    def inflight(self) -> Path:
        return self.run / "engine.inflight.json"

    @property
    def started_with(self) -> Path:
        return self.run / "started_with.json"

    @property
    def kv(self) -> Path:
        return self.state / "kv"

    @property
    def journal(self) -> Path:
        return self.state / "crashes.jsonl"

    @property
    def quarantine(self) -> Path:
        return self.state / "quarantine.json"

    @property
    def supervision(self) -> Path:
        return self.state / "supervision.json"

    @property
    def engine_stderr(self) -> Path:
        return self.logs / "engine.err.log"

    def make_dirs(self) -> None:
        for d in (self.run, self.logs, self.state, self.generated):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run, 0o700)  # the control socket lives here


def write_atomic(path: Path, data: str | bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Write a whole file or nothing: a kill -9 at any moment leaves either
    the old content or the new (temp file, rename). `durable` adds an fsync,
    for files that must also survive a power cut. The temp file is a hidden
    sibling, `.<name>.<pid>.<random>.tmp`, already in `mode`; one that a
    killed writer left behind is removed by the next write of the same file."""
    raw = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        os.write(fd, raw)
        if durable:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove the temp files of `path` that killed writers left (write_atomic's
    pattern only, and only where that writer is gone); the ones removed."""
    pattern = re.compile(re.escape(f".{path.name}.") + r"(\d+)\.[A-Za-z0-9_]+\.tmp")
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None:
            continue
        try:
            if _writer_gone(int(m.group(1)), entry.stat(follow_symlinks=False).st_mtime):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:  # a concurrent cleaner, or a writer that just finished
            pass
    return removed


def _writer_gone(pid: int, mtime: float) -> bool:
    """True when no live process can still be writing a temp file of this pid
    last written at `mtime`: the pid is dead (or a zombie), or was reused by a
    process started after that (create_time is exact to about a second)."""
    import psutil  # only when a leftover exists

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        return mtime < proc.create_time() - 1.0
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, ValueError, OverflowError):  # someone else's live process; no pid at all
        return False


def write_json_atomic(path: Path, obj: Any, durable: bool = True) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True), durable=durable)


def read_json(path: Path) -> Any | None:
    """A JSON file's content, or None when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
