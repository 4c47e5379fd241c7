"""A rank group as supervisord's engine program (pure parts): the
`mlx.launch` command that starts every rank, and the group's exit status.

`mlx.launch` kills the other ranks when one exits, then exits 0 itself
whatever happened, and says per rank on stderr: "Node with rank K exited
with code C" (C < 0: killed by signal -C). The group's status is the first
rank's own failure -- not the SIGTERM the launcher then sent the others --
so a rank's SIGABRT is journaled as `sigabrt` as for a one-process engine.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from mlxd.config import RanksConfig

RANK_EXIT = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")


def launch_argv(ranks: RanksConfig, python: str) -> list[str]:
    """mlx.launch's options for this group (the engine command follows them)."""
    launcher = str(Path(python).with_name("mlx.launch"))
    where = ["--hostfile", ranks.hostfile] if ranks.hostfile else ["--hosts", ",".join(ranks.hosts)]
    # The engine command that follows starts with this Python's full path: the
    # same path must hold mlxd on every Mac of the group.
    return [launcher, *where, "--backend", ranks.backend, "--starting-port", str(ranks.starting_port)]


def group_returncode(lines: list[str], launcher_returncode: int) -> int:
    """The group's exit, as a Popen returncode (< 0: the signal), from
    mlx.launch's stderr lines and its own exit code."""
    codes: dict[int, int] = {}
    cause = None
    for line in lines:
        m = RANK_EXIT.search(line)
        if m is None:
            continue
        rank, code = int(m.group(1)), int(m.group(2))
        codes.setdefault(rank, code)
        if cause is None and code not in (0, -signal.SIGTERM):
            cause = code
    if cause is not None:
        return cause
    if 0 in codes:
        return codes[0]
    return launcher_returncode if not codes else next(iter(codes.values()))
