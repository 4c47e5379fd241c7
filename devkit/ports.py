"""Free loopback ports for the processes a test or a benchmark starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Below Linux's default ephemeral range (ip_local_port_range 32768-60999), so no
# outgoing connection of another process is handed one of these ports.
FIXED_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it; 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
