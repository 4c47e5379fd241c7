"""The prompt cache's writes under way: handed to the writer's thread
(engine/cache/kv_writer.py), collected on the worker's once done.

The worker stages a write (engine/cache/kv_files.py: a block's own copy, or
numpy views of a whole entry's arrays, which stay alive until the write is
collected) and hands it to `KVWriter`; `collect` takes the finished ones:
their views dropped on this thread, their files into the disk's index, the
earlier turns' files they replace deleted, their entry told where it is on
disk. A write that failed (a full disk) costs the disk tier, never a request.
"""

from __future__ import annotations

import logging
import time
from .cache_entries import Entry, Writing
from .disk_speeds import DiskSpeeds
from .kv_files import KVFiles
from .kv_format import DiskEntry
from .kv_writer import KVWriter, StagedWrite
from .reuse import supersedes

log = logging.getLogger("mlxd.engine.cache.prompt_cache")


class CacheWrites:
    """The writes under way, in order (worker thread only); `done`, `failed`:
    the writes collected on disk, and those that failed, for the cache's figures."""

    def __init__(self, files: KVFiles | None, speeds: DiskSpeeds) -> None:
        self.files = files
        self.speeds = speeds
        self._writer = KVWriter(files.before_commit) if files is not None else None
        self.under_way: list[Writing] = []
        self.done = 0
        self.failed = 0

    @property
    def pending(self) -> bool:
        """Writes the writer has not handed back yet."""
        return self._writer is not None and bool(self._writer.pending)

    def held_bytes(self) -> int:
        """Memory the writes hold that no entry in memory counts (Writing.held_bytes)."""
        return sum(w.held_bytes for w in self.under_way)

    def of(self, entry: Entry) -> Writing | None:
        """The write of this memory entry under way, if any."""
        return next((w for w in self.under_way if w.entry is entry), None)

    def submit(self, staged: StagedWrite | None, entry: Entry | None, in_memory: bool) -> Writing | None:
        """A staged write to the writer: of `entry` (None: a prompt's
        checkpoint), which stays in memory or not."""
        assert self._writer is not None
        if staged is None:  # over the disk budget
            return None
        writing = Writing(staged, entry if in_memory else None, entry.replaces if entry else (),
                          entry.nbytes if entry else 0, time.monotonic())
        if entry is not None:
            entry.replaces = ()  # the write deletes them once it is on disk
        staged.token = writing
        self.under_way.append(writing)
        self._writer.submit(staged)
        log.debug("prompt cache: staged %d file(s), %d MiB", len(staged.files), staged.nbytes >> 20)
        return writing

    def collect(self, block: bool = False, timeout: float = 60.0) -> bool:
        """Collects the writes the writer has finished: their files into the
        index, the arrays of evicted entries freed (here, on the worker).
        Whether any was."""
        if not self.pending:
            return False
        assert self._writer is not None and self.files is not None
        done = self._writer.finished(block=block, timeout=timeout)
        for staged in done:
            staged.drop_views()  # the views of MLX arrays, dropped on this thread
            writing: Writing = staged.token
            staged.token = None  # no cycle left between the two: the entry's arrays go when nothing else holds them
            self.under_way.remove(writing)
            if staged.error is not None:  # a full disk costs the disk tier, never a request
                log.warning("prompt cache: cannot write an entry: %s", staged.error)
                self.failed += 1
                self.files.abandon(staged)
                continue
            written = self.files.commit(staged)
            if written is not None:
                self._written(writing, written)
        if done:
            self.speeds.save()  # beside the entries just written (a write may have measured the disk)
        return bool(done)

    def close(self) -> None:
        """The writer's thread ended (the engine stops)."""
        if self._writer is not None:
            self._writer.close()

    def _written(self, writing: Writing, written: DiskEntry) -> None:
        assert self.files is not None
        if writing.entry is not None:
            writing.entry.file = written
        self.done += 1
        # Earlier turns of its conversation only take room now (a file of the same tokens is this one).
        self.files.delete(d for d in writing.replaces if d.path != written.path)
        # Files this one extends (or, with agent-safe keys, a later turn of) only take room now.
        self.files.delete_where(lambda d: d is not written and d.model_key == written.model_key
                                and supersedes(written, d))
        self.speeds.note_write(writing.staged.nbytes, writing.staged.seconds)
