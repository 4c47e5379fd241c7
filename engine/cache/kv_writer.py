"""Prompt-cache files written off the worker thread.

An evicted entry used to be written to disk on the worker thread, between
two steps: with a prompt cache squeezed by a big model every new turn
evicts one, and the write (hundreds of MB, then fsync) stalled the batch's
other rows and the next queued request (docs/BENCHMARKS.md, "Why the engine
is built as it is"). Now the worker only stages the file (`stage_file`: the
safetensors header, and numpy views of the entry's arrays -- no copy; only
the worker thread touches MLX arrays) and `KVWriter`'s thread does the I/O:
a temporary file, fsync, the rename into place, fsync of the folder. The entry's arrays stay alive (the
worker holds them) until the worker collects the finished write, so the
views stay valid and MLX never reuses their buffers meanwhile.

The file is exactly what mlx-lm's `save_prompt_cache` writes (safetensors:
the caches' states flattened, their metadata as strings), so `load` reads
it back with mlx-lm's `load_prompt_cache` as before.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

# MLX's dtypes by the names safetensors gives them.
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "uint8": "U8",
                      "uint16": "U16", "uint32": "U32", "uint64": "U64", "int8": "I8", "int16": "I16",
                      "int32": "I32", "int64": "I64", "bool": "BOOL"}


@dataclass
class StagedFile:
    """A file to write: its header and the arrays' bytes in order: numpy
    views, or a block's device copies (MLX arrays, contiguous, their
    computation queued: the writer reads them; the worker drops them)."""

    final: Path
    tmp: Path
    header: bytes
    parts: list[Any]
    nbytes: int


@dataclass
class StagedWrite:
    """One entry's files, written in order: a turn's new blocks, then its
    manifest, whose rename makes the entry (engine/cache/kv_files.py); or one
    whole-entry file."""

    files: list[StagedFile]
    disk_entry: Any = None  # what the index records once the files are in place (engine/cache/kv_files.py)
    new_blocks: dict[str, int] = field(default_factory=dict)  # hash -> bytes: the blocks this write adds
    token: Any = None  # the caller's own record of this write, handed back when it is done
    error: str | None = field(default=None)
    seconds: float = 0.0  # the writer's time on it (not its wait in the queue)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def drop_views(self) -> None:
        """The views of MLX arrays let go (on the worker thread: no MLX array is freed on the writer's)."""
        for f in self.files:
            f.parts = []


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """The safetensors header (its 8-byte length, then JSON padded to 8 bytes)
    for (name, safetensors dtype, shape, bytes) written in this order (pure)."""
    doc: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def host_view(a: Any) -> np.ndarray:
    """A numpy view of an MLX array's memory (evaluated first, if it is not);
    a bfloat16 array's bits as uint16 (numpy has no bfloat16)."""
    m = memoryview(a)
    if m.format != "bfloat16":
        return np.asarray(m)
    if not m.c_contiguous:
        import mlx.core as mx

        return np.asarray(memoryview(a.view(mx.uint16)))
    return np.frombuffer(m.cast("B"), dtype="<u2").reshape(m.shape)


def stage_file(final: Path, tmp: Path, cache: list[Any], metadata: dict[str, str]) -> StagedFile:
    """The file mlx-lm's save_prompt_cache would write for `cache`, staged
    for the writer: worker thread (it reads MLX arrays). Views, not copies:
    the caller keeps `cache` alive until the write is collected."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # As save_prompt_cache lays a cache out (mlx-lm 0.32; tests/engine/test_kv_writer.py compares the two):
    # the states' scalars as arrays, listed with their kinds, beside the metadata and the classes.
    scalars: list[Any] = [""]  # never empty, or tree_flatten would drop it
    arrays = {}
    for key, value in tree_flatten([c.state for c in cache]):
        if not isinstance(value, mx.array):
            kind = "none" if value is None else "string" if isinstance(value, str) else "scalar"
            if kind == "scalar" and not isinstance(value, (int, float, bool)):
                raise ValueError(f"a cache state mlx-lm cannot save: {value!r}")
            scalars.append((key, kind))
            value = (mx.array([]) if value is None else mx.array([ord(ch) for ch in value]) if kind == "string"
                     else mx.array(value))
        arrays[key] = value
    meta = dict(tree_flatten([metadata, [type(c).__name__ for c in cache], scalars]))
    mx.eval(list(arrays.values()))
    tensors, parts = [], []
    for name, a in arrays.items():
        dtype = str(a.dtype).removeprefix("mlx.core.")
        view = host_view(a) if a.size else np.zeros(0, np.uint8)  # numpy has no bfloat16: its bits as uint16
        tensors.append((name, SAFETENSORS_DTYPES[dtype], tuple(a.shape), int(a.nbytes)))
        parts.append(view)
    header = safetensors_header(tensors, {k: str(v) for k, v in meta.items()})
    return StagedFile(final, tmp, header, parts, len(header) + sum(t[3] for t in tensors))


def write_all(staged: StagedWrite, before_commit: Callable[[], None] = lambda: None) -> None:
    """An entry's files in order (writer thread), each fsynced and renamed
    into place, the folders they went into fsynced once at the end (not once
    a file: a turn's blocks reach disk sooner); `before_commit` runs before
    the last file's rename."""
    folders = []
    for i, f in enumerate(staged.files):
        write_file(f, before_commit if i == len(staged.files) - 1 else lambda: None, sync_folder=False)
        if f.final.parent not in folders:
            folders.append(f.final.parent)
    for folder in folders:
        _fsync_folder(folder)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(staged: StagedFile, before_commit: Callable[[], None] = lambda: None, sync_folder: bool = True) -> None:
    """The I/O (writer thread): the temporary file, fsync, the rename, fsync of the folder."""
    staged.tmp.parent.mkdir(parents=True, exist_ok=True)
    staged.final.parent.mkdir(parents=True, exist_ok=True)
    try:
        with staged.tmp.open("wb") as fh:
            fh.write(staged.header)
            for part in staged.parts:
                # a strided view (an entry's arrays are slices of longer buffers) is copied here, off the worker;
                # a block's device copy (engine/cache/kv_blocks.py) is read to the host here, once computed
                host = part if isinstance(part, np.ndarray) else host_view(part)
                fh.write(np.ascontiguousarray(host).data)
            fh.flush()
            os.fsync(fh.fileno())
        before_commit()
        os.replace(staged.tmp, staged.final)
        if sync_folder:
            _fsync_folder(staged.final.parent)
    finally:
        staged.tmp.unlink(missing_ok=True)


class KVWriter:
    """One thread that writes staged files in order; the worker submits and
    collects (`finished`, `wait`), and nothing else crosses threads."""

    def __init__(self, before_commit: Callable[[], None] = lambda: None) -> None:
        self.before_commit = before_commit
        self._todo: queue.Queue[StagedWrite | None] = queue.Queue()
        self._done: queue.Queue[StagedWrite] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.pending = 0  # submitted, not yet collected (worker thread only)

    def submit(self, staged: StagedWrite) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxd-kv-writer", daemon=True)
            self._thread.start()
        self.pending += 1
        self._todo.put(staged)

    def finished(self, block: bool = False, timeout: float | None = None) -> list[StagedWrite]:
        """The writes done since the last call (error set where one failed);
        `block`: wait for at least one while any is pending."""
        out = []
        if block and self.pending:
            try:
                out.append(self._done.get(timeout=timeout))
            except queue.Empty:
                return []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def close(self) -> None:
        """The thread ends once the writes before this are done (a later submit starts another)."""
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join(60)
            self._thread = None

    def _run(self) -> None:
        while (staged := self._todo.get()) is not None:
            started = time.perf_counter()
            try:
                write_all(staged, self.before_commit)
                staged.seconds = time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001 - a full disk (or a bug here) costs the disk tier, never
                staged.error = f"{type(exc).__name__}: {exc}"  # a request, and never stops this thread
            # The views stay: the worker drops them when it collects the write, so that
            # no MLX array is freed on this thread.
            self._done.put(staged)
            del staged
