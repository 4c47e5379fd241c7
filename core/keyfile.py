"""Key files: a random key generated on first use, kept in a 0600 file,
compared in constant time, never logged. The gateway's key ($MLXD_HOME/key,
gateway/keys.py) and the engine's ($MLXD_HOME/engine.key: what a gateway
sends an engine that requires it, engine.require_key) are both such files."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from typing import Callable

from mlxd.paths import remove_stale_temps


ENGINE_KEY_PREFIX = "sk-mlxd-engine-"


def new_key(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def ensure_key_file(path: Path, prefix: str = "", make: Callable[[], str] | None = None) -> str:
    """The key in `path`, created (mode 0600) if there is none yet: `make()`,
    else a new key with `prefix`. Two processes creating it at once (the
    engine and the gateway start together) agree: the key is written whole to
    a temp file that is then linked into place, which never replaces a file;
    a kill at any moment leaves no key or a whole one."""
    try:
        return read_key(path)
    except FileNotFoundError:
        pass
    key = make() if make is not None else new_key(prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # write_atomic's pattern
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (key + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process's key is in place: that one counts
    finally:
        tmp.unlink(missing_ok=True)
    return read_key(path)


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


def bearer(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header value."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None
