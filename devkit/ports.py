"""Free loopback ports for the processes a test or a benchmark starts."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

# Below Linux's default ephemeral range (ip_local_port_range 32768-60999), so no
# outgoing connection of another process is handed one of these ports.
FIXED_PORTS = range(20000, 32000)


CLAIM_FOLDER = Path(tempfile.gettempdir()) / f"mlxd-test-ports-{os.getuid()}"
CLAIM_TTL_S = 3600.0  # a claim older than this may be handed out again


def claim(port: int, folder: Path = CLAIM_FOLDER, now: float | None = None) -> bool:
    """Whether `port` is ours to give: not handed out (by any process of this
    user) in the last CLAIM_TTL_S. The OS gives a port nothing listens on
    *now*, so two test workers asking at once could both get it and the
    second process to start would find it taken (or the first one's engine
    answering there)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(port)
    now = time.time() if now is None else now
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        try:
            if now - path.stat().st_mtime < CLAIM_TTL_S:
                return False
            os.utime(path, (now, now))
            return True
        except OSError:
            return False


def free_port(attempts: int = 100) -> int:
    """A port nothing listens on right now (the OS picks it; 127.0.0.1) and
    no other free_port call on this machine handed out within the hour."""
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if claim(port):
            return port
    raise RuntimeError(f"no unclaimed free port in {attempts} tries")


def ephemeral_low() -> int:
    """The first port the OS hands out for outgoing connections (32768 where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_run(count: int, attempts: int = 200) -> int:
    """The first of `count` consecutive ports free right now (mlx.launch's
    ring backend binds `starting_port` + rank). Taken below the ephemeral
    range: there the OS's picks (free_port) and outgoing connections, which
    can hold any port of the range, never land on one of them."""
    top = min(FIXED_PORTS.stop, ephemeral_low()) - count
    for _ in range(attempts):
        first = random.randrange(FIXED_PORTS.start, top)
        if all(_bindable(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports found in {attempts} tries")


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port with connections in TIME_WAIT counts as taken
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
