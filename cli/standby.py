"""A standby engine: `python -m mlxd.cli.standby FD` (mlxd.standby says why).

Started by the standby keeper with one end of a socket pair as FD. It
imports what an engine imports before it reads weights -- the app, mlx-lm,
transformers -- tells the keeper it is ready, and waits. On `go` it takes
the runner's stdin, stdout and stderr, environment, working directory and
arguments, and runs `mlxd engine` as the runner would have. If the keeper
goes away first, it exits: it holds no model and nothing else.

It does not touch the accelerator before `go`: MLX is imported (on a Mac
that opens the Metal device, a few MB) but allocates nothing.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import time

from mlxd.standby import Channel, HandoverError, close_all

# What an engine imports before its weights, heaviest last (transformers comes with mlx_lm.utils).
PRELOAD = ("mlxd.cli.main", "mlxd.engine.main", "mlx.core", "mlx.nn", "mlx_lm", "mlx_lm.utils",
           "mlx_lm.generate", "mlx_lm.models.cache", "mlx_lm.sample_utils", "mlx_lm.tokenizer_utils")


def take_over(go: dict, fds: list[int]) -> list[str]:
    """Become the runner's engine: its stdio, environment and working
    directory; returns the arguments for `mlxd` (after `-m mlxd.cli`)."""
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    close_all(fds)
    os.chdir(go["cwd"])
    os.environ.clear()
    os.environ.update(go["env"])
    argv = list(go["argv"])
    # The runner's command is [python, "-m", "mlxd.cli", *args]: what follows the module is mlxd's.
    args = argv[argv.index("mlxd.cli") + 1:] if "mlxd.cli" in argv else argv[1:]
    sys.argv = [argv[0], *args]
    return args


def main() -> int:
    channel = Channel(socket.socket(fileno=int(sys.argv[1])))
    began = time.monotonic()
    from mlxd.engine.cpu.fast_blas import activate as activate_fast_blas

    activate_fast_blas()  # before MLX is imported, as the engine does first (Linux's CPU backend)
    for name in PRELOAD:
        importlib.import_module(name)
    import_s = round(time.monotonic() - began, 3)
    try:
        channel.send({"ready": True, "pid": os.getpid(), "import_s": import_s})
        go, fds = channel.recv()
    except (HandoverError, OSError):
        return 0  # the keeper is gone or discarded us
    channel.close()
    if go.get("op") != "go" or len(fds) != 3:
        close_all(fds)
        print(f"mlxd standby: not a handover: {go!r}", file=sys.stderr)
        return 2
    args = take_over(go, fds)
    import mlxd
    from mlxd.cli.main import main as mlxd_main

    mlxd.STARTED_AT = time.time()  # the engine's life (and /health's start timings) begins here
    print(f"mlxd: engine {os.getpid()} taken over from a standby (imports done {import_s:.2f} s before)",
          file=sys.stderr, flush=True)
    return mlxd_main(args)


if __name__ == "__main__":
    sys.exit(main())
