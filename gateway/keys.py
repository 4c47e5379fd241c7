"""The gateway key: generated on first run, kept in $MLXD_HOME/key (0600),
rotatable, compared in constant time, never logged."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from mlxd.paths import StatePaths, write_atomic

PREFIX = "sk-mlxd-"


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def ensure_key(paths: StatePaths) -> str:
    """The key, created (mode 0600) if there is none yet."""
    try:
        return read_key(paths.key)
    except FileNotFoundError:
        key = new_key()
        write_atomic(paths.key, key + "\n", mode=0o600)
        return key


def rotate_key(paths: StatePaths) -> str:
    key = new_key()
    write_atomic(paths.key, key + "\n", mode=0o600)
    return key


def read_key(path: Path) -> str:
    key = path.read_text().strip()
    if not key:
        raise FileNotFoundError(f"{path} is empty")
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, 0o600)  # never leave it readable by others
    return key


def matches(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())
