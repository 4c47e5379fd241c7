"""Key files: a random key generated on first use, kept in a 0600 file,
compared in constant time, never logged. The gateway's key ($MLXD_HOME/key,
gateway/keys.py) and the engine's ($MLXD_HOME/engine.key: what every client
of the engine's port sends it -- the gateway, the crash listener, the CLI)
are both such files. Both are read again when they change (KeyFile), so
`mlxd key rotate` takes effect without restarting the process that checks."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Callable, Iterable

from mlxd.paths import remove_stale_temps, write_atomic


ENGINE_KEY_PREFIX = "sk-mlxd-engine-"
# Who a caller is to the engine's stored responses: set by the gateway (a
# hash of the key the caller presented, never the key), read by the engine.
OWNER_HEADER = "x-mlxd-owner"


def owner_of_key(key: str) -> str:
    """The owner a caller's key stands for (pure): a hash, so the key itself never leaves the gateway."""
    return hashlib.sha256(b"mlxd-owner:" + key.encode()).hexdigest()[:32]


def owner_headers(asgi_headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The owner header the gateway's key guard set on a request, to pass on to the engine (pure)."""
    name = OWNER_HEADER.encode()
    return {OWNER_HEADER: v.decode("latin-1") for k, v in asgi_headers if k == name}


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


def rotate_key_file(path: Path, prefix: str = "", make: Callable[[], str] | None = None) -> str:
    """A new key in `path` (0600, replaced whole: a kill leaves the old key or
    the new one): `make()`, else a new key with `prefix`. The old one stops
    working at the checker's next request (KeyFile)."""
    key = make() if make is not None else new_key(prefix)
    write_atomic(path, key + "\n", mode=0o600)
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


def bearer(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header value."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


def authorization_key(authorization: str | None) -> str | None:
    """The key of an `Authorization` header value: `Bearer <key>`, or Basic
    with the key as the password (`curl -u :KEY`, a URL's `user:KEY@`), as
    most HTTP tools can send one or the other (pure)."""
    key = bearer(authorization)
    if key is not None or not authorization or authorization[:6].lower() != "basic ":
        return key
    try:
        decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    return password if colon and password else None


def engine_headers(path: Path) -> dict[str, str]:
    """What a client of the engine's port sends: its key as `Authorization:
    Bearer`; nothing where the key file is not there yet (no engine has
    started in this home, so there is no engine to answer either)."""
    return KeyFile(path).headers()


class KeyFile:
    """A key file read again whenever it changes (its mtime): a rotated key
    takes effect at the next request. `current()` is None while there is no
    file. One per checking process; the file is the key's one owner."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key: str | None = None
        self._mtime: int | None = None

    def current(self) -> str | None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return None
        if mtime != self._mtime:
            try:
                self._key, self._mtime = read_key(self.path), mtime
            except OSError:
                return None
        return self._key

    def headers(self) -> dict[str, str]:
        """What a long-lived client of the engine sends now (engine_headers, kept current)."""
        key = self.current()
        return {"Authorization": f"Bearer {key}"} if key else {}
