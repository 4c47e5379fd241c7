"""The prompt cache's disk tier: one safetensors file per entry under
$MLXD_HOME/state/kv/, in mlx-lm's prompt-cache format (`save_prompt_cache`),
with the entry's tokens and provenance in the file's metadata.

A file is written into kv/tmp/, flushed to disk and renamed into place, so a
kill at any moment leaves either a whole entry or a temporary file that the
next scan deletes. The prompt cache has the I/O done off the worker
thread (`stage` here, the write in engine/cache/kv_writer.py, `commit` here).
Files that are corrupt, partial or foreign (another model's build, another
MLX version, a model no longer configured) are deleted when seen. The index of files (tokens, sizes) lives in memory; the
worker thread is its only reader and writer, and the only thread that
touches an MLX array (the writer sees numpy views of the bytes).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from mlxd.paths import write_atomic

from .kv_writer import StagedFile, stage_file, write_file

log = logging.getLogger("mlxd.engine.cache.prompt_cache")

FORMAT = "mlxd-kv-1"
RATES_FILE = "rates.json"  # measured disk-read and prefill speeds (prompt_cache.py)
MAX_HEADER_BYTES = 64 * 2**20  # tokens live in the header: 100k tokens take ~0.5 MB


class KVFileError(Exception):
    """An entry file that cannot be used (it has been deleted)."""


@dataclass(frozen=True, eq=False)
class DiskEntry:
    path: Path
    model_key: str
    tokens: np.ndarray
    prompt_len: int
    trimmable: bool
    nbytes: int
    conversation: tuple[str, ...] = ()
    patchable: bool = False  # every layer a plain KVCache (engine/cache/reuse.py)
    echo: tuple[int, ...] = ()  # its answer's first tokens as the next prompt holds them (engine/cache/reuse.py)


def is_patchable(kv: list[Any]) -> bool:
    """Whether spans inside this cache can be recomputed in place: every
    layer a plain KVCache, whose offset can be set back and forth."""
    from mlx_lm.models.cache import KVCache

    return bool(kv) and all(isinstance(c, KVCache) for c in kv)


def versions() -> dict[str, str]:
    """What a file must have been written with to be read back."""
    import mlx.core as mx
    import mlx_lm

    return {"format": FORMAT, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


def model_id_of(model_key: str) -> str:
    return model_key.split("@", 1)[0]


def read_header(path: Path) -> dict[str, str]:
    """The safetensors file's metadata, read without its tensors."""
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise KVFileError(f"{path.name} is truncated")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise KVFileError(f"{path.name} has a {n}-byte header")
        body = fh.read(n)
    if len(body) != n:
        raise KVFileError(f"{path.name} is truncated")
    try:
        meta = json.loads(body).get("__metadata__") or {}
    except (json.JSONDecodeError, AttributeError) as exc:
        raise KVFileError(f"{path.name} has no readable header") from exc
    # save_prompt_cache flattens [metadata, classes, scalars]: ours is "0.*".
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


def parse_entry(path: Path, meta: dict[str, str], expected: dict[str, str]) -> DiskEntry:
    """The index row for a file whose metadata is `meta` (pure but for the size)."""
    for key, want in expected.items():
        if meta.get(key) != want:
            raise KVFileError(f"{path.name} was written with {key} {meta.get(key)!r}, not {want!r}")
    try:
        tokens = np.frombuffer(base64.b64decode(meta["tokens"]), dtype="<i4").astype(np.int32)
        entry = DiskEntry(path, meta["model"], tokens, int(meta["prompt_len"]), meta["trimmable"] == "1",
                          path.stat().st_size, tuple(filter(None, meta.get("conversation", "").split(","))),
                          meta.get("patchable") == "1", tuple(int(t) for t in meta.get("echo", "").split(",") if t))
    except (KeyError, ValueError, TypeError) as exc:
        raise KVFileError(f"{path.name} has incomplete metadata") from exc
    if not len(tokens):
        raise KVFileError(f"{path.name} covers no tokens")
    return entry


def kv_nbytes(kv: list[Any]) -> int:
    """Bytes an entry's arrays really hold (buffers included)."""
    return sum(int(c.nbytes) for c in kv)


def compact(kv: list[Any]) -> list[Any]:
    """Shallow copies, as mlx-lm's own classes (the file names them), whose
    arrays hold only the tokens covered (a KV layer's buffer is allocated in
    steps, or for a whole request, and keeps what a trim cut off)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out = []
    for c in kv:
        if isinstance(c, KVCache) and c.keys is not None:
            o = c.offset
            c = KVCache.from_state((c.keys[..., :o, :], c.values[..., :o, :], o))
        elif isinstance(c, QuantizedKVCache) and c.keys is not None:
            o = c.offset
            c = QuantizedKVCache.from_state((tuple(a[..., :o, :] for a in c.keys),
                                             tuple(a[..., :o, :] for a in c.values), o, c.group_size, c.bits))
        out.append(c)
    return out


class KVFiles:
    """The folder of entry files and its in-memory index (worker thread only)."""

    def __init__(self, folder: Path, budget_bytes: int, configured_models: Iterable[str],
                 before_commit: Callable[[], None] = lambda: None) -> None:
        self.folder = folder
        self.before_commit = before_commit  # fault injection: a kill between the write and the rename
        self.budget_bytes = budget_bytes
        self.expected = versions()
        self.rejected = 0  # files deleted as corrupt, partial or foreign
        self._index: dict[Path, DiskEntry] = {}  # least recently used first (kept in order, no stat per request)
        self._scan(set(configured_models))

    # --- the index ------------------------------------------------------------
    @property
    def count(self) -> int:
        return len(self._index)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._index.values())

    def entries(self, model_key: str) -> list[DiskEntry]:
        """This model's entries, least recently used first."""
        return [e for e in self._index.values() if e.model_key == model_key]

    def delete_where(self, superseded: Callable[[DiskEntry], bool]) -> None:
        """Delete the entries a newer one made useless (prompt_cache.supersedes)."""
        for e in list(self._index.values()):
            if superseded(e):
                self._delete(e.path)

    def delete(self, entries: Iterable[DiskEntry]) -> None:
        """Delete these entries (a later turn of their conversation replaced them)."""
        for e in entries:
            if e.path in self._index:
                self._delete(e.path)

    def forget_other_builds(self, model_key: str) -> None:
        """Delete entries of the same model id written for other weights."""
        mid = model_id_of(model_key)
        for e in list(self._index.values()):
            if model_id_of(e.model_key) == mid and e.model_key != model_key:
                self._reject(e.path, "written for another build of the model")

    def _scan(self, configured: set[str]) -> None:
        shutil.rmtree(self.folder / "tmp", ignore_errors=True)  # writes a kill interrupted
        if not self.folder.is_dir():
            return
        # Oldest first: the files' times give the LRU order once; from here on it is kept in memory.
        for path in sorted(self.folder.glob("*"), key=_mtime):
            if path.is_dir() or path.name == RATES_FILE or path.name.startswith(f".{RATES_FILE}."):
                continue
            if path.suffix != ".safetensors":
                self._reject(path, "not an entry file")
                continue
            try:
                entry = parse_entry(path, read_header(path), self.expected)
            except (KVFileError, OSError) as exc:
                self._reject(path, str(exc))
                continue
            if model_id_of(entry.model_key) not in configured:
                self._reject(path, f"model {model_id_of(entry.model_key)!r} is no longer configured")
                continue
            self._index[path] = entry
        self._enforce_budget()
        if self._index:
            log.info("prompt cache: %d entries on disk (%.0f MiB)", self.count, self.total_bytes / 2**20)

    # --- reading and writing ----------------------------------------------------
    def load(self, entry: DiskEntry) -> list[Any]:
        """The entry's KV, checked against its metadata; a file that fails is deleted."""
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.models.cache import load_prompt_cache

        try:
            meta = read_header(entry.path)
            if parse_entry(entry.path, meta, self.expected).model_key != entry.model_key:
                raise KVFileError(f"{entry.path.name} changed on disk")
            kv = load_prompt_cache(str(entry.path))
            # mx.load is lazy: read now, so a bad file fails here and the read is timed.
            mx.eval([a for c in kv for _, a in tree_flatten(c.state) if isinstance(a, mx.array)])
        except (KVFileError, OSError, RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
            self._reject(entry.path, str(exc))
            raise KVFileError(f"cannot read {entry.path.name}: {exc}") from None
        offsets = {c.offset for c in kv if hasattr(c, "offset")}
        if entry.trimmable and offsets != {len(entry.tokens)}:
            self._reject(entry.path, "its arrays do not cover its tokens")
            raise KVFileError(f"{entry.path.name} does not cover its tokens")
        os.utime(entry.path)  # used: most recent, for the next engine's scan too
        self._index[entry.path] = self._index.pop(entry.path)
        return kv

    def stage(self, model_key: str, tokens: np.ndarray, prompt_len: int, kv: list[Any],
              conversation: tuple[str, ...] = (), echo: tuple[int, ...] = ()) -> StagedFile | None:
        """An entry's file staged for the writer (engine/cache/kv_writer.py), with
        its DiskEntry-to-be; None when it cannot fit the disk budget."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        kv = compact(kv)
        if kv_nbytes(kv) > self.budget_bytes:
            return None
        trimmable = can_trim_prompt_cache(kv)
        name = hashlib.sha256(model_key.encode() + tokens.astype("<i4").tobytes()).hexdigest()[:32]
        final = self.folder / f"{name}.safetensors"
        tmp = self.folder / "tmp" / f"{uuid.uuid4().hex}.safetensors"
        meta = {**self.expected, "model": model_key, "prompt_len": str(prompt_len), "trimmable": "1" if trimmable else "0",
                "patchable": "1" if is_patchable(kv) else "0", "echo": ",".join(map(str, echo)),
                "tokens": base64.b64encode(tokens.astype("<i4").tobytes()).decode(), "conversation": ",".join(conversation)}
        staged = stage_file(final, tmp, kv, meta)
        staged.disk_entry = DiskEntry(final, model_key, tokens.copy(), prompt_len, trimmable, staged.nbytes, conversation,
                                 is_patchable(kv), echo)
        return staged

    def commit(self, staged: StagedFile) -> DiskEntry:
        """A written file into the index, as the most recent entry."""
        entry: DiskEntry = staged.disk_entry
        self._index.pop(entry.path, None)
        self._index[entry.path] = entry
        self._enforce_budget(keep=entry.path)
        return entry

    def write(self, model_key: str, tokens: np.ndarray, prompt_len: int, kv: list[Any],
              conversation: tuple[str, ...] = (), echo: tuple[int, ...] = ()) -> DiskEntry | None:
        """Write an entry atomically, here and now; None when it cannot fit the disk budget."""
        staged = self.stage(model_key, tokens, prompt_len, kv, conversation, echo)
        if staged is None:
            return None
        write_file(staged, self.before_commit)
        return self.commit(staged)

    def load_rates(self) -> dict[str, float]:
        try:
            rates = json.loads((self.folder / RATES_FILE).read_text())
            return {k: float(v) for k, v in rates.items() if isinstance(v, (int, float)) and v > 0}
        except (OSError, ValueError, AttributeError):
            return {}

    def save_rates(self, rates: dict[str, float | None]) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.folder / RATES_FILE, json.dumps(rates), durable=False)
        except OSError as exc:
            log.warning("prompt cache: cannot save measured speeds: %s", exc)

    # --- upkeep ------------------------------------------------------------------
    def _enforce_budget(self, keep: Path | None = None) -> None:
        """Least recently used files go until the rest fit the disk budget."""
        for e in list(self._index.values()):
            if self.total_bytes <= self.budget_bytes:
                return
            if e.path != keep:
                self._delete(e.path)

    def _reject(self, path: Path, why: str) -> None:
        log.warning("prompt cache: removing %s: %s", path.name, why)
        self.rejected += 1
        self._delete(path)

    def _delete(self, path: Path) -> None:
        self._index.pop(path, None)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("prompt cache: cannot remove %s: %s", path, exc)


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0
