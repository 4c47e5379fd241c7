"""What the launchd and systemd units share (pure): the command that runs
mlxd and the service's environment. How long a clean stop may take is
supervisord's (mlxd.supervisor.supervisord_conf.stop_timeout_s)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from mlxd.config import CONFIG_ENV, Config

# A service starts with a bare environment: name every directory it may need
# (Homebrew on Apple Silicon, then Intel, then the system's).
BASE_PATH = ("/opt/homebrew/bin", "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")

# The documented config overrides (core/config_loading.py) that `install`
# carries into the unit, so the service runs the config `mlxd up` would run
# now. Nothing else: never a key, never a fault-injection switch.
PASSTHROUGH_ENV = CONFIG_ENV


def mlxd_argv(python: str | None = None) -> list[str]:
    """The command that runs `mlxd` (without a subcommand): this venv's python
    by absolute path. Not resolved through symlinks: a venv's python is a
    link to the base interpreter, and only the link finds the venv."""
    return [os.path.abspath(python or sys.executable), "-m", "mlxd.cli"]


def default_path_env(python: str | None = None) -> str:
    """PATH for the service: the venv's bin first, then BASE_PATH."""
    return ":".join(dict.fromkeys([os.path.dirname(mlxd_argv(python)[0]), *BASE_PATH]))


def check_argv(argv: list[str]) -> list[str]:
    if not argv or not os.path.isabs(argv[0]):
        raise ValueError(f"the mlxd command must start with an absolute path, got {argv!r}")
    return list(argv)


def service_env(config: Config, path_env: str, extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The service's whole environment; every path in it absolute."""
    if not config.home.is_absolute():
        raise ValueError(f"MLXD_HOME must be absolute, got {config.home}")
    entries = path_env.split(":")
    if not all(os.path.isabs(e) for e in entries):
        raise ValueError(f"every PATH entry must be absolute, got {path_env!r}")
    env = {"PATH": path_env, "MLXD_HOME": str(config.home)}
    for name, value in (extra_env or {}).items():
        if name not in PASSTHROUGH_ENV:
            raise ValueError(f"{name} is not one of mlxd's config overrides {PASSTHROUGH_ENV}")
        if name == "MLXD_CONFIG" and not os.path.isabs(value):
            raise ValueError(f"MLXD_CONFIG must be absolute, got {value!r}")
        env[name] = value
    return env
