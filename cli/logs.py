"""`mlxd logs [component] [-f]`: the tail of a component's log files, and
follow them. supervisord writes and rotates them under $MLXD_HOME/logs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mlxd.paths import StatePaths

FILES = {
    "engine": ("engine.err.log", "engine.log"),
    "gateway": ("gateway.log",),
    "listener": ("listener.log",),
    "standby": ("standby.log",),
    "supervisord": ("supervisord.log",),
}


def log_files(paths: StatePaths, component: str) -> list[Path]:
    names = [n for c in FILES for n in FILES[c]] if component == "all" else list(FILES[component])
    return [paths.logs / n for n in names]


def tail_lines(path: Path, n: int) -> list[str]:
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - 256 * 1024))
            return f.read().decode(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def run_logs(paths: StatePaths, component: str, follow: bool, lines: int) -> int:
    files = log_files(paths, component)
    existing = [f for f in files if f.exists()]
    if not existing:
        print(f"no logs yet in {paths.logs} (is mlxd running? `mlxd up`)", file=sys.stderr)
        return 1
    prefix = len(existing) > 1
    for f in existing:
        for line in tail_lines(f, lines):
            print(f"{f.name}: {line}" if prefix else line)
    if not follow:
        return 0
    offsets = {f: f.stat().st_size for f in existing}
    try:
        while True:
            for f in files:
                try:
                    size = f.stat().st_size
                except OSError:
                    continue
                start = offsets.get(f, 0)
                if size < start:  # rotated
                    start = 0
                if size > start:
                    with f.open("rb") as fh:
                        fh.seek(start)
                        chunk = fh.read(size - start).decode(errors="replace")
                    offsets[f] = size
                    for line in chunk.splitlines():
                        print(f"{f.name}: {line}" if prefix else line, flush=True)
            time.sleep(0.25)
    except KeyboardInterrupt:
        return 0
