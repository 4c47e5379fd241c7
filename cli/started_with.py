"""What `mlxd up` started with, remembered for the commands that follow it.

`up` takes its ports, hosts, Ollama URL and config file from mlxd.toml and
the MLXD_* variables of its own shell; `status`, `down`, `logs` and
`restart` (and `doctor`, `models`, `key`, which read it) are often run from
another shell, without those variables, and
would otherwise probe the defaults and call a running stack "down". So `up`
writes what it resolved to $MLXD_HOME/run/started_with.json (a StartedWith
record) and those commands take from it every variable not set now:

  a variable set now  >  what `up` started with  >  mlxd.toml

`mlxd down` removes the file: nothing runs then, and a later `up` starts
from its own environment and mlxd.toml only, never from a past `up`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from mlxd.config import CONFIG_ENV, Config
from mlxd.paths import StatePaths
from mlxd.records import StartedWith

# The variables mlxd.config reads for the config file and the stack's addresses.
OVERRIDE_VARS = CONFIG_ENV
# The commands that talk to (or read the files of) a stack `up` started.
STACK_COMMANDS = frozenset({"status", "down", "logs", "restart", "doctor", "models", "key"})

Purpose = Literal["reach", "start"]


def given_overrides(env: Mapping[str, str]) -> dict[str, str]:
    """The override variables set in `env` (pure)."""
    return {name: env[name] for name in OVERRIDE_VARS if name in env}


def started_with(config: Config, config_file: Path, env: Mapping[str, str], up_pid: int,
                 now: float) -> StartedWith:
    """The record `up` writes for the stack it is about to start (pure)."""
    return StartedWith(config=str(config_file), engine_host=config.engine.host, engine_port=config.engine.port,
                       gateway_host=config.gateway.host, gateway_port=config.gateway.port,
                       ollama_url=config.gateway.ollama_url, env=given_overrides(env), up_pid=up_pid,
                       started=now)


def resolved_overrides(record: StartedWith) -> dict[str, str]:
    """Every value `up` resolved, as the variable that sets it (pure)."""
    return {"MLXD_CONFIG": record.config, "MLXD_ENGINE_HOST": record.engine_host,
            "MLXD_ENGINE_PORT": str(record.engine_port), "MLXD_GATEWAY_HOST": record.gateway_host,
            "MLXD_GATEWAY_PORT": str(record.gateway_port), "MLXD_OLLAMA_URL": record.ollama_url}


def overrides_for(now: Mapping[str, str], record: StartedWith | None, purpose: Purpose) -> dict[str, str]:
    """The MLXD_* overrides a command runs with (pure). A variable set `now`
    always wins. Otherwise, to reach the running stack ("reach": status,
    down, logs, restart's stop and wait), every value `up` resolved, so that
    a port edited in mlxd.toml since is not probed before a restart applies
    it; to start the stack again ("start": `restart all`), only the
    variables `up` was given, so that it applies an edited mlxd.toml as
    `down` then `up` from that shell would."""
    chosen = given_overrides(now)
    if record is None:
        return chosen
    remembered = resolved_overrides(record) if purpose == "reach" else given_overrides(record.env)
    return {**remembered, **chosen}


def use_overrides(overrides: Mapping[str, str]) -> None:
    """Make this process's environment carry exactly these overrides:
    mlxd.config reads os.environ, and a supervisord that `restart all`
    starts passes it on to the engine and the gateway."""
    for name in OVERRIDE_VARS:
        if name in overrides:
            os.environ[name] = overrides[name]
        else:
            os.environ.pop(name, None)


def read(paths: StatePaths) -> StartedWith | None:
    """What the last `up` in this home started with; None when nothing is
    remembered (never started, stopped by `down`, or an unreadable file)."""
    return StartedWith.read(paths.started_with)


def remember(config: Config, config_file: Path, paths: StatePaths) -> StartedWith:
    """Write what this `up` starts with (atomically, before supervisord
    starts: `status` may run while the engine loads)."""
    record = started_with(config, config_file, os.environ, os.getpid(), time.time())
    paths.make_dirs()
    record.write(paths.started_with, durable=False)  # lost with a power cut, as the stack is
    return record


def forget(paths: StatePaths, writer_pid: int | None = None) -> None:
    """Remove the record once the stack is stopped; with `writer_pid`, only
    when that `up` wrote it (a newer `up` may have written its own)."""
    if writer_pid is not None:
        record = read(paths)
        if record is None or record.up_pid != writer_pid:
            return
    paths.started_with.unlink(missing_ok=True)
