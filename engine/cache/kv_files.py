"""The prompt cache's disk tier, under $MLXD_HOME/state/kv/: the folder and its index.

An entry is a manifest over content-addressed blocks of 256 tokens, or one
whole safetensors file where the KV cannot be cut into blocks (the formats:
engine/cache/kv_format.py). Blocks are shared by every entry whose tokens
start the same: a turn writes its new blocks and a manifest, not the whole
conversation again; they are counted once against the disk budget, and go
with the last manifest that names them.

Every file is written into kv/tmp/, flushed to disk and renamed into place,
and a manifest only after its blocks, so a kill at any moment leaves either
a whole entry or files that the next scan deletes (temporary ones, blocks
no manifest names). The prompt cache has the I/O done off the worker
thread (`stage` here, the write in engine/cache/kv_writer.py, `commit` here).
Files that are corrupt, partial or foreign (another model's build, another
MLX version, a model no longer configured) are deleted when seen. The index of files (tokens, sizes) lives in memory; the
worker thread is its only reader and writer, and the only thread that
touches an MLX array (the writer sees numpy views of the bytes).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from .disk_speeds import RATES_FILE
from .kv_blocks import BlockError, assemble, block_spans, chain_hashes, layer_layout, read_block, stage_blocks
from .kv_format import (DiskEntry, KVFileError, compact, entry_name, is_patchable, kv_nbytes, manifest_doc,
                        model_id_of, parse_entry, parse_manifest, read_header, versions)
from .kv_writer import StagedFile, StagedWrite, stage_file
from .reuse import supersedes

log = logging.getLogger("mlxd.engine.cache.prompt_cache")


@dataclass
class Block:
    path: Path
    nbytes: int
    refs: int = 0  # manifests in the index that name it


class KVFiles:
    """The folder of entries and its in-memory index (worker thread only)."""

    def __init__(self, folder: Path, budget_bytes: int, configured_models: Iterable[str],
                 before_commit: Callable[[], None] = lambda: None) -> None:
        self.folder = folder
        self.blocks_folder = folder / "blocks"
        self.before_commit = before_commit  # fault injection: a kill between the write and the rename
        self.budget_bytes = budget_bytes
        self.expected = versions()
        self.rejected = 0  # files deleted as corrupt, partial or foreign
        self._index: dict[Path, DiskEntry] = {}  # least recently used first (kept in order, no stat per request)
        self._blocks: dict[str, Block] = {}  # on disk, by hash
        self._staged_blocks: dict[str, int] = {}  # staged by a write not yet collected: hash -> bytes
        self._pins: Counter[str] = Counter()  # blocks that writes not yet collected count on (not writing them)
        self._scan(set(configured_models))

    # --- the index ------------------------------------------------------------
    @property
    def count(self) -> int:
        return len(self._index)

    @property
    def total_bytes(self) -> int:
        return (sum(e.file_bytes if e.blocks else e.nbytes for e in self._index.values())
                + sum(b.nbytes for b in self._blocks.values()))

    @property
    def block_count(self) -> int:
        return len(self._blocks)

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
        if self.blocks_folder.is_dir():
            for path in self.blocks_folder.iterdir():
                try:
                    self._blocks[path.stem] = Block(path, path.stat().st_size)
                except OSError:
                    continue
        block_bytes = {h: b.nbytes for h, b in self._blocks.items()}
        # Oldest first: the files' times give the LRU order once; from here on it is kept in memory.
        for path in sorted(self.folder.glob("*"), key=_mtime):
            if path.is_dir() or path.name == RATES_FILE or path.name.startswith(f".{RATES_FILE}."):
                continue
            try:
                if path.suffix == ".json":
                    entry = parse_manifest(path, json.loads(path.read_bytes()), self.expected, block_bytes)
                    entry = replace(entry, file_bytes=path.stat().st_size)
                elif path.suffix == ".safetensors":
                    entry = parse_entry(path, read_header(path), self.expected)
                else:
                    self._reject(path, "not an entry file")
                    continue
            except (KVFileError, OSError, ValueError) as exc:
                self._reject(path, str(exc))
                continue
            if model_id_of(entry.model_key) not in configured:
                self._reject(path, f"model {model_id_of(entry.model_key)!r} is no longer configured")
                continue
            self._add(entry)
        self._drop_superseded()
        for h in [h for h, b in self._blocks.items() if b.refs == 0]:  # a write a kill cut short, or foreign
            self._drop_block(h)
        self._enforce_budget()
        if self._index:
            log.info("prompt cache: %d entries on disk (%.0f MiB, %d blocks)", self.count, self.total_bytes / 2**20,
                     len(self._blocks))

    def _drop_superseded(self) -> None:
        """Entries a later one of theirs made useless (a prompt's, once its
        turn was written: a kill can fall between the turn's write and the
        prompt's deletion). Only entries whose first block is the same can
        be a prefix of one another; with agent-safe keys, the whole index.
        Where two replace each other (the same keys), the longer stays,
        then the later (file times are too coarse to tell a prompt's entry
        from its turn's, written moments apart)."""
        order = {path: i for i, path in enumerate(self._index)}

        def replaces(r: DiskEntry, e: DiskEntry) -> bool:
            if r is e or r.model_key != e.model_key or not supersedes(r, e):
                return False
            return not supersedes(e, r) or (len(r.tokens), order[r.path]) > (len(e.tokens), order[e.path])

        groups: dict[tuple[str, str], list[DiskEntry]] = {}
        for e in self._index.values():
            groups.setdefault((e.model_key, e.blocks[0] if e.blocks else str(e.path)), []).append(e)
        keyed = [e for e in self._index.values() if e.conversation]
        for e in list(self._index.values()):
            rivals = groups[(e.model_key, e.blocks[0] if e.blocks else str(e.path))] + keyed
            if any(replaces(r, e) for r in rivals):
                self._delete(e.path)

    # --- reading and writing ----------------------------------------------------
    def load(self, entry: DiskEntry) -> list[Any]:
        """The entry's KV, checked against its metadata; a file that fails is deleted."""
        kv = self._load_blocks(entry) if entry.blocks else self._load_file(entry)
        os.utime(entry.path)  # used: most recent, for the next engine's scan too
        self._index[entry.path] = self._index.pop(entry.path)
        return kv

    def _load_blocks(self, entry: DiskEntry) -> list[Any]:
        arrays = []
        for h, (start, end) in zip(entry.blocks, block_spans(len(entry.tokens))):
            block = self._blocks.get(h)
            try:
                if block is None:
                    raise BlockError(f"block {h} is gone")
                arrays.append(read_block(block.path, entry.layout, end - start))
            except BlockError as exc:
                # Every entry that names it has lost its KV: they go, and the block with them.
                for e in [e for e in self._index.values() if h in e.blocks]:
                    self._reject(e.path, f"a block of it cannot be read: {exc}")
                self._drop_block(h)
                raise KVFileError(f"cannot read {entry.path.name}: {exc}") from None
        return assemble(entry.layout, arrays)

    def _load_file(self, entry: DiskEntry) -> list[Any]:
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
        return kv

    @staticmethod
    def block_names(model_key: str, tokens: np.ndarray, layout: list[str]) -> list[str]:
        """The names of the blocks these tokens make (kv_blocks.chain_hashes, seeded by the build and layout)."""
        return chain_hashes(f"{model_key}|{','.join(layout)}", tokens)

    def unwritten_tokens(self, tokens: np.ndarray, names: list[str]) -> int:
        """Tokens of these that `stage` would copy into new blocks (none on disk or staged yet)."""
        return sum(end - start for h, (start, end) in zip(names, block_spans(len(tokens)))
                   if h not in self._blocks and h not in self._staged_blocks)

    def stage(self, model_key: str, tokens: np.ndarray, prompt_len: int, kv: list[Any],
              conversation: tuple[str, ...] = (), echo: tuple[int, ...] = (),
              names: list[str] | None = None) -> StagedWrite | None:
        """An entry's files staged for the writer (engine/cache/kv_writer.py),
        with its DiskEntry-to-be: the blocks not yet on disk (or staged) and a
        manifest, or a whole file where the KV cannot be cut into blocks.
        None when it cannot fit the disk budget."""
        layout = layer_layout(kv)
        if layout is None:
            return self._stage_file(model_key, tokens, prompt_len, kv, conversation, echo)
        name = entry_name(model_key, tokens)
        hashes = names if names is not None else self.block_names(model_key, tokens, layout)
        todo: dict[str, tuple[int, int]] = {}
        for h, span in zip(hashes, block_spans(len(tokens))):
            if h not in self._blocks and h not in self._staged_blocks and h not in todo:
                todo[h] = span
        files = stage_blocks([(self.blocks_folder / f"{h}.safetensors", self._tmp()) for h in todo], kv,
                             list(todo.values()), {**self.expected, "model": model_key})
        new = {h: staged.nbytes for h, staged in zip(todo, files)}
        nbytes = sum(new.get(h) or self._staged_blocks.get(h) or self._blocks[h].nbytes for h in hashes)
        if nbytes > self.budget_bytes:
            return None
        entry = DiskEntry(self.folder / f"{name}.json", model_key, tokens.copy(), prompt_len, True, nbytes,
                          conversation, is_patchable(kv), echo, tuple(hashes), tuple(layout))
        doc = manifest_doc(entry, self.expected)
        files.append(StagedFile(entry.path, self._tmp(), doc, [], len(doc)))
        self._pins.update(h for h in hashes if h not in new)  # the blocks it counts on stay until it is collected
        self._staged_blocks.update(new)
        return StagedWrite(files, replace(entry, file_bytes=len(doc)), new)

    def _stage_file(self, model_key: str, tokens: np.ndarray, prompt_len: int, kv: list[Any],
                    conversation: tuple[str, ...], echo: tuple[int, ...]) -> StagedWrite | None:
        from mlx_lm.models.cache import can_trim_prompt_cache

        kv = compact(kv)
        if kv_nbytes(kv) > self.budget_bytes:
            return None
        trimmable = can_trim_prompt_cache(kv)
        final = self.folder / f"{entry_name(model_key, tokens)}.safetensors"
        meta = {**self.expected, "model": model_key, "prompt_len": str(prompt_len), "trimmable": "1" if trimmable else "0",
                "patchable": "1" if is_patchable(kv) else "0", "echo": ",".join(map(str, echo)),
                "tokens": base64.b64encode(tokens.astype("<i4").tobytes()).decode(), "conversation": ",".join(conversation)}
        staged = stage_file(final, self._tmp(), kv, meta)
        return StagedWrite([staged], DiskEntry(final, model_key, tokens.copy(), prompt_len, trimmable, staged.nbytes,
                                               conversation, is_patchable(kv), echo, file_bytes=staged.nbytes))

    def _tmp(self) -> Path:
        return self.folder / "tmp" / f"{uuid.uuid4().hex}.tmp"

    def commit(self, staged: StagedWrite) -> DiskEntry | None:
        """A written entry into the index, as the most recent one (None: a
        block it counts on went missing meanwhile, and it was deleted)."""
        entry: DiskEntry = staged.disk_entry
        for h, nbytes in staged.new_blocks.items():
            self._staged_blocks.pop(h, None)
            self._blocks[h] = Block(self.blocks_folder / f"{h}.safetensors", nbytes)
        if any(h not in self._blocks for h in entry.blocks):
            self._unpin(entry, staged)
            self._reject(entry.path, "a block it counts on failed to reach disk")
            return None
        same = self._index.pop(entry.path, None)  # the same tokens written before: its manifest was replaced
        self._add(entry)
        for h in same.blocks if same is not None else ():
            if h in self._blocks:
                self._blocks[h].refs -= 1
                self._drop_if_unused(h)
        self._unpin(entry, staged)
        self._enforce_budget(keep=entry.path)
        return entry

    def abandon(self, staged: StagedWrite) -> None:
        """A write that failed: what it staged is forgotten (files it left are deleted at the next scan)."""
        for h in staged.new_blocks:
            self._staged_blocks.pop(h, None)
        self._unpin(staged.disk_entry, staged)

    def _unpin(self, entry: DiskEntry, staged: StagedWrite) -> None:
        for h in entry.blocks:
            if h not in staged.new_blocks:
                self._pins[h] -= 1
                if self._pins[h] <= 0:
                    del self._pins[h]
                self._drop_if_unused(h)

    # --- upkeep ------------------------------------------------------------------
    def _add(self, entry: DiskEntry) -> None:
        self._index[entry.path] = entry
        for h in entry.blocks:
            self._blocks[h].refs += 1

    def _enforce_budget(self, keep: Path | None = None) -> None:
        """Least recently used entries go until the rest fit the disk budget
        (an entry's blocks go with the last entry that names them)."""
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
        entry = self._index.pop(path, None)
        _unlink(path)
        for h in entry.blocks if entry is not None else ():
            b = self._blocks.get(h)
            if b is not None:
                b.refs -= 1
                self._drop_if_unused(h)

    def _drop_if_unused(self, h: str) -> None:
        b = self._blocks.get(h)
        if b is not None and b.refs <= 0 and not self._pins.get(h):
            self._drop_block(h)

    def _drop_block(self, h: str) -> None:
        b = self._blocks.pop(h, None)
        if b is not None:
            _unlink(b.path)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("prompt cache: cannot remove %s: %s", path, exc)


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0
