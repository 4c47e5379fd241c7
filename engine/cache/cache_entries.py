"""What the prompt cache holds (engine/cache/prompt_cache.py): an entry in
memory, and a write of one (or of a prompt's checkpoint) under way on the
writer's thread (engine/cache/cache_writes.py collects it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .kv_format import DiskEntry, is_patchable
from .kv_writer import StagedWrite


@dataclass(eq=False)
class Entry:
    model_key: str
    tokens: np.ndarray
    prompt_len: int
    kv: list[Any]  # mlx-lm cache objects, one per layer
    nbytes: int
    conversation: tuple[str, ...] = ()  # agent-safe keys of the request (engine/cache/cache_keys.py)
    file: DiskEntry | None = None  # its copy on disk, once written
    name: str = ""  # the cache's name for its conversation (kept by the turns that continue it)
    replaces: tuple[DiskEntry, ...] = ()  # earlier turns' files, deleted once this one is on disk
    echo: tuple[int, ...] = ()  # its answer's first tokens as the next prompt will hold them (engine/cache/reuse.py)

    @property
    def trimmable(self) -> bool:
        return trimmable(self.kv)

    @property
    def patchable(self) -> bool:
        return is_patchable(self.kv)


@dataclass(eq=False)
class Writing:
    """A write the writer has under way: what the disk's index will hold once
    it is done, and the memory entry it was made from while that stays."""

    staged: StagedWrite
    entry: Entry | None  # the memory entry written, while it is in memory (None: it left, or there is none)
    replaces: tuple[DiskEntry, ...]  # earlier turns' files, deleted once this one is on disk
    entry_bytes: int
    started: float

    @property
    def views_entry(self) -> bool:
        """A whole-entry file: its views keep the entry's arrays alive until it is collected."""
        return not self.staged.disk_entry.blocks

    @property
    def held_bytes(self) -> int:
        """Memory the write holds that no entry in memory counts: a block
        write's copies; a whole file's arrays once their entry left."""
        if self.views_entry:
            return 0 if self.entry is not None else self.entry_bytes
        return self.staged.nbytes



def trimmable(kv: list[Any]) -> bool:
    from mlx_lm.models.cache import can_trim_prompt_cache

    return bool(kv) and can_trim_prompt_cache(kv)
