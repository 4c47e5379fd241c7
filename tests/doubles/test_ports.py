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


def test_a_port_is_claimed_once_until_the_claim_expires(tmp_path):
    assert ports.claim(40001, tmp_path, now=1000.0)
    assert not ports.claim(40001, tmp_path, now=1000.0 + ports.CLAIM_TTL_S - 1)  # another worker asking: taken
    assert ports.claim(40002, tmp_path, now=1000.0)
    (tmp_path / "40001").touch()
    stale = (tmp_path / "40001").stat().st_mtime + ports.CLAIM_TTL_S + 1
    assert ports.claim(40001, tmp_path, now=stale)  # an hour on: free to give again
    assert not ports.claim(40001, tmp_path, now=stale + 1)


def test_free_port_never_hands_out_a_port_twice():
    given = [ports.free_port() for _ in range(200)]
    assert len(set(given)) == len(given)
