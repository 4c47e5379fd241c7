"""Where mlxd keeps its state: one directory ($MLXD_HOME), one layout.

  mlxd.toml                      the config (the single source of truth)
  key                            the gateway key (0600)
  engine.key                     the engine's key, where engine.require_key (0600)
  run/   supervisord.sock, supervisord.pid, engine.pid, engine.exit.json,
         engine.inflight.json    (live process state; stale after a crash),
         started_with.json       (what `mlxd up` started with; `mlxd down` removes it)
  logs/  supervisord.log, engine.log, engine.err.log, listener.log
  state/ crashes.jsonl, quarantine.json, supervision.json,
         kv/ (the prompt cache's disk tier: one safetensors file per entry),
         responses/ (stored Responses API answers, for previous_response_id)
  generated/ supervisord.conf    (generated from mlxd.toml, never edited)
  models/ demo-a, demo-b          (built-in demo models)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


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
    def standby_socket(self) -> Path:
        return self.run / "standby.sock"

    @property
    def standby(self) -> Path:
        return self.run / "standby.json"

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
    def responses(self) -> Path:
        return self.state / "responses"

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
    sibling, `.<name>.<pid>.<random>.tmp` (temp_name), already in `mode`; one
    that a killed writer left behind is removed by the next write of the same file."""
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


def build_folder_once(dest: Path, build_into: Callable[[Path], None], complete: Callable[[Path], bool],
                      replaceable: Callable[[Path], bool] = lambda _folder: True, attempts: int = 5) -> bool:
    """Make the folder `dest` by `build_into(folder)` unless `complete(dest)`
    already; True when this call's build was put in place.

    A build fills a hidden sibling temp folder (temp_name) that is renamed
    into place whole, so a kill at any moment never leaves a half folder at
    `dest`, and the temps that dead builders left (their pid gone, or reused
    since) are removed first. Concurrent builders each build their own: the
    first rename wins and the others, finding `dest` complete, discard theirs.
    A folder at `dest` that is not complete is replaced where `replaceable`
    says so (a stale or half build); otherwise FileExistsError. Whatever
    `build_into` raises propagates, its temp folder removed."""
    dest = Path(dest)
    if complete(dest):
        return False
    _refuse_foreign(dest, replaceable)  # before the work, not after it
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest)
    tmp = _make_temp_dir(dest)
    try:
        build_into(tmp)
        error: OSError | None = None
        for _attempt in range(attempts):
            try:  # fails while dest is a folder with files in it (another builder's, or a stale one)
                os.rename(tmp, dest)
                return True
            except OSError as exc:
                error = exc
            if complete(dest):
                return False  # another builder finished first: keep theirs
            _discard(dest, replaceable)
        raise RuntimeError(f"could not move the build into {dest}") from error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_temp_dir(dest: Path) -> Path:
    """A new, empty temp folder beside `dest` with this process's pid in its name."""
    while True:
        tmp = dest.parent / temp_name(dest.name, os.getpid(), uuid.uuid4().hex[:8])
        try:
            tmp.mkdir()  # the umask's mode, as any folder the builder makes
            return tmp
        except FileExistsError:
            continue


def _discard(dest: Path, replaceable: Callable[[Path], bool]) -> None:
    """Remove the folder at `dest` (FileExistsError where it may not be
    replaced): first renamed to a temp of ours, so that a kill while it is
    being deleted leaves a dead builder's temp, not half a folder at `dest`."""
    if not dest.exists() and not dest.is_symlink():
        return
    _refuse_foreign(dest, replaceable)
    trash = _make_temp_dir(dest)
    try:
        os.rename(dest, trash)  # onto our empty temp folder
    except FileNotFoundError:  # another builder moved it first
        pass
    shutil.rmtree(trash, ignore_errors=True)


def _refuse_foreign(dest: Path, replaceable: Callable[[Path], bool]) -> None:
    """FileExistsError when something at `dest` may not be replaced by a build."""
    if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or not replaceable(dest))):
        raise FileExistsError(f"{dest} exists and is not a build of this kind; not replacing it")


def temp_name(target: str, pid: int, tag: str) -> str:
    """The hidden temp sibling of `target` that process `pid` writes or builds
    (write_atomic, build_folder_once): `.<target>.<pid>.<tag>.tmp` (pure)."""
    return f".{target}.{pid}.{tag}.tmp"


_TEMP = re.compile(r"\.(?P<target>.+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp")


def temp_pid(name: str, target: str | None = None) -> int | None:
    """The pid in `name` when it is a temp_name of `target` (of anything with
    target None); None for any other name (pure)."""
    m = _TEMP.fullmatch(name)
    if m is None or (target is not None and m.group("target") != target):
        return None
    return int(m.group("pid"))


def builder_gone(started: float | None, temp_mtime: float) -> bool:
    """True when no live process can still be at work on a temp last changed
    at `temp_mtime` (pure). `started`: when the process that now has the
    temp's pid started (None: there is none, or it is a zombie). A process
    started after the temp last changed reused the pid of its dead builder
    (create times are exact to about a second)."""
    return started is None or temp_mtime < started - 1.0


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove the temps of `path` (files of write_atomic, folders of
    build_folder_once) whose writer is gone (builder_gone); the ones removed."""
    return remove_dead_temps(path.parent, path.name)


def remove_dead_temps(folder: Path, target: str | None = None) -> list[Path]:
    """Remove the temps in `folder` of `target` (of anything with target
    None) whose writer is gone (builder_gone); the ones removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        pid = temp_pid(entry.name, target)
        if pid is None:
            continue
        try:
            if builder_gone(_process_started(pid), entry.stat(follow_symlinks=False).st_mtime):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:  # a concurrent cleaner, or a writer that just finished
            pass
    return removed


def _process_started(pid: int) -> float | None:
    """When the process with this pid started; None when there is none or it
    is a zombie (which writes nothing any more); -inf where that cannot be
    known (someone else's process: taken as alive)."""
    import psutil  # only when a leftover exists

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except psutil.NoSuchProcess:
        return None
    except (psutil.Error, ValueError, OverflowError):  # someone else's live process; no pid at all
        return float("-inf")


def write_json_atomic(path: Path, obj: Any, durable: bool = True) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True), durable=durable)


def read_json(path: Path) -> Any | None:
    """A JSON file's content, or None when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
