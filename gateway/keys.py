"""The gateway key: generated on first run, kept in $MLXD_HOME/key (0600),
rotatable, compared in constant time, never logged."""

from __future__ import annotations

from mlxd.keyfile import ensure_key_file, matches, new_key as _new_key, owner_of_key, read_key, rotate_key_file
from mlxd.paths import StatePaths

__all__ = ["PREFIX", "ensure_key", "matches", "new_key", "owner_of_key", "read_key", "rotate_key"]
PREFIX = "sk-mlxd-"


def new_key() -> str:
    return _new_key(PREFIX)


def ensure_key(paths: StatePaths) -> str:
    """The key, created (mode 0600) if there is none yet."""
    return ensure_key_file(paths.key, make=lambda: new_key())  # looked up when called (tests replace it)


def rotate_key(paths: StatePaths) -> str:
    return rotate_key_file(paths.key, make=lambda: new_key())  # looked up when called, as ensure_key's
