"""The standby engine's handover, as the three processes in it speak it.

A crashed engine's replacement spends most of its start importing Python
(transformers, mlx-lm, the web stack: ~1.4 s on a slow CPU) before it reads
a byte of weights. The standby keeper (supervisor/standby.py, supervisord's
`standby` program) keeps one engine process with all of that imported and
no model loaded (cli/standby.py). When supervisord starts the engine's
runner, the runner asks the keeper for that process instead of starting a
new interpreter; the standby takes the runner's stdio, environment, working
directory and arguments, and becomes the engine. The keeper is its parent,
so the keeper reports its exit status back to the runner, which records it
as always (run/engine.exit.json): crash classification is unchanged.

Messages are one JSON object a line over a unix socket; file descriptors
(the runner's stdin, stdout, stderr) travel beside the first byte of a
message (SCM_RIGHTS). Everything here is stdlib: the runner and the keeper
start in milliseconds.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

MAX_FDS = 3
MAX_LINE = 1 << 20  # an environment and an argv: far below this


class HandoverError(OSError):
    """The other side closed or sent something that is not a message."""


class Channel:
    """One end of a handover socket: whole messages in, whole messages out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._fds: list[int] = []

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        if fds:
            if socket.send_fds(self.sock, [data[:1]], fds) != 1:  # the descriptors ride on the first byte
                raise HandoverError("could not send the descriptors")
            data = data[1:]
        self.sock.sendall(data)

    def recv(self) -> tuple[dict[str, Any], list[int]]:
        """The next message and the descriptors that came with it. Raises
        HandoverError on EOF (the other side is gone) or garbage."""
        while b"\n" not in self._buf:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, MAX_FDS)
            self._fds += fds
            if not data:
                self.close_fds()
                raise HandoverError("closed")
            self._buf += data
            if len(self._buf) > MAX_LINE:
                self.close_fds()
                raise HandoverError("message too long")
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        fds, self._fds = self._fds, []
        try:
            message = json.loads(line)
        except ValueError as exc:
            close_all(fds)
            raise HandoverError(f"not a message: {exc}") from exc
        if not isinstance(message, dict):
            close_all(fds)
            raise HandoverError("not a message")
        return message, fds

    def close_fds(self) -> None:
        close_all(self._fds)
        self._fds = []

    def close(self) -> None:
        self.close_fds()
        self.sock.close()


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
