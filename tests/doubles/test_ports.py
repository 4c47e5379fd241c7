"""devkit/ports.py: the ports tests and benchmarks give the processes they start."""

import socket

from mlxd.devkit import ports
from mlxd.devkit.ports import FIXED_PORTS, ephemeral_low, free_port_run


def test_a_port_run_is_free_and_below_the_ports_outgoing_connections_get():
    for count in (1, 2, 4):
        first = free_port_run(count)
        assert FIXED_PORTS.start <= first and first + count <= min(FIXED_PORTS.stop, ephemeral_low())
        sockets = [socket.socket() for _ in range(count)]
        try:
            for i, s in enumerate(sockets):
                s.bind(("127.0.0.1", first + i))  # raises if any port of the run was taken
        finally:
            for s in sockets:
                s.close()


def test_a_port_run_passes_over_a_taken_port(monkeypatch):
    taken = socket.socket()
    held = free_port_run(4) + 1  # held, with the port before it and the two after it free
    taken.bind(("127.0.0.1", held))
    try:
        picks = iter([held - 1, held, held + 1])  # runs of 2: over the held port twice, then past it
        monkeypatch.setattr(ports.random, "randrange", lambda *_: next(picks))
        assert free_port_run(2) == held + 1
    finally:
        taken.close()
