"""A turn's cached prefix handed out by the prompt cache (PromptCache.fetch):
from memory -- the entry itself where the turn continues its conversation,
else a copy cut back to what the prompt shares -- or read from disk where
that saves more and is worth the read (disk_speeds.py), after waiting for a
write under way of an entry that would serve it better; the figures counted.
Functions of the cache (engine/cache/prompt_cache.py), which owns the state.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import replace
from typing import Any

import numpy as np

from mlxd.reports import ReuseLine

from .kv_format import KVFileError
from .prompt_cache_policy import NOT_CACHED, Fetched
from .reuse import Reuse, explain

log = logging.getLogger("mlxd.engine.cache.prompt_cache")


def fetch(cache: Any, prompt: list[int], answer_room: int, read_room: int) -> Fetched:
    """PromptCache.fetch (its docstring says what): the turn's KV out of memory
    or read from disk, whichever serves it further, and the figures counted."""
    if not cache.enabled or cache.model_key is None:
        return NOT_CACHED
    cache.settle()
    tokens = np.asarray(prompt, dtype=np.int32)
    in_memory = cache.plan(cache.entries, tokens)
    _await_writes_that_serve(cache, tokens, in_memory.reused if in_memory else 0)
    fetched = None
    if cache.files is not None and (in_memory is None or in_memory.tokens < len(tokens) - 1):
        fetched = _from_disk(cache, tokens, in_memory.reused if in_memory else 0, answer_room, read_room)
    if fetched is None and in_memory is not None:
        fetched = _take(cache, in_memory, tokens, answer_room)
    if fetched is None:
        fetched = Fetched(None, 0, 0, "none", name=cache.new_name())
        stopped, why = explain(None, None, len(tokens), len(cache.entries) + cache.disk_entries())
        cache.reports.add(ReuseLine(fetched.name, len(tokens), 0, stopped, why))
    s = cache.stats
    cache.stats = replace(s, requests=s.requests + 1, hits=s.hits + (fetched.cached_tokens > 0),
                         disk_hits=s.disk_hits + (fetched.source == "disk"),
                         prompt_tokens=s.prompt_tokens + len(prompt),
                         cached_tokens=s.cached_tokens + fetched.cached_tokens,
                         recomputed_tokens=s.recomputed_tokens + sum(b - a for a, b in fetched.patches))
    cache.keep_within(cache.room_now())
    cache.publish()
    return fetched


def _take(cache: Any, reuse: Reuse, tokens: np.ndarray, answer_room: int) -> Fetched:
    """The entry in memory the plan chose: itself (the turn continues it) or a copy, cut and packed for the turn."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, trim_prompt_cache

    from .kv_cache import packed

    entry = cache.entries[reuse.index]
    writing = cache.writes.of(entry)
    if writing is not None:
        writing.entry = None  # the turn holds it now: the write's views (if any) count as held
    if reuse.copy:
        # Cut a copy, not the entry. A plain KVCache's trim only moves its offset,
        # so a shallow copy can be cut and then packed into arrays of its own;
        # other layers write into their arrays in place and are deep-copied.
        kv = [copy.copy(c) if isinstance(c, (KVCache, QuantizedKVCache)) else copy.deepcopy(c) for c in entry.kv]
        cache.entries.remove(entry)
        cache.entries.append(entry)  # used: most recent now
        name, replaces = cache.new_name(), ()
    else:
        kv = entry.kv
        cache.entries.remove(entry)  # continued by this turn, which replaces it
        cache.stats = replace(cache.stats, superseded=cache.stats.superseded + 1)
        name, replaces = entry.name, entry.replaces + ((entry.file,) if entry.file is not None else ())
    fetched = cache.reports.fetched(reuse, entry, tokens, kv, "memory", name, replaces)
    if reuse.trim:
        trim_prompt_cache(kv, reuse.trim)
    # A whole file still being written reads the entry's arrays: the turn must not write into them.
    shared = reuse.copy or (writing is not None and writing.views_entry)
    return replace(fetched, kv=packed(kv, len(tokens) - reuse.tokens + answer_room, shared=shared,
                                      coarse=cache.coarse_steps))


def _from_disk(cache: Any, tokens: np.ndarray, memory_tokens: int, answer_room: int,
               read_room: int) -> Fetched | None:
    """A disk entry that saves more than memory does, read if worth it."""
    assert cache.files is not None
    candidates = cache.files.entries(cache.model_key)
    reuse = cache.plan(candidates, tokens)
    if reuse is None or reuse.reused <= memory_tokens:
        return None
    found = candidates[reuse.index]
    if not cache.speeds.worth_reading(found.nbytes, reuse.reused - memory_tokens,
                                     max(cache.budget_bytes, read_room, 0), cache.max_read_s):
        log.info("prompt cache: not reading %s (%d MiB): slower than the prefill it saves or over the "
                 "room for it", found.path.name, found.nbytes >> 20)
        return None
    cache.keep_within(cache.room_now())
    started = time.monotonic()
    try:
        kv = cache.files.load(found)
    except KVFileError as exc:
        log.warning("prompt cache: %s; removed", exc)
        return None
    elapsed = max(time.monotonic() - started, 1e-6)
    cache.speeds.note_read(found.nbytes, elapsed)  # every read is timed
    log.info("prompt cache: read %d tokens from disk in %.3fs", len(found.tokens), elapsed)
    # A disk entry is read into memory: the file stays for other branches unless this turn continues it.
    fetched = cache.reports.fetched(reuse, found, tokens, kv, "disk", cache.new_name(), () if reuse.copy else (found,))
    if reuse.trim:
        from mlx_lm.models.cache import trim_prompt_cache

        trim_prompt_cache(kv, reuse.trim)
    from .kv_cache import packed

    return replace(fetched, kv=packed(kv, len(tokens) - reuse.tokens + answer_room, coarse=cache.coarse_steps))


def _await_writes_that_serve(cache: Any, tokens: np.ndarray, reused: int) -> None:
    """An entry being written, not in memory, that would serve this prompt
    better than memory does: wait for its file (then read as any other)."""
    away = [w for w in cache.writes.under_way if w.entry is None]
    if not away:
        return
    best = cache.plan([w.staged.disk_entry for w in away], tokens)
    if best is not None and best.reused > reused:
        wanted = away[best.index]
        cache.wait_for_writes(lambda: wanted in cache.writes.under_way)
