"""The prompt cache: an agent's next turn reuses the KV of the conversation so far.

Agents resend the whole conversation every turn; prefilling all of it again
costs seconds to minutes on a long prompt. The cache keeps the KV of earlier
requests (mlx-lm's cache objects, as `make_prompt_cache` builds them) keyed by
the tokens they cover; a new prompt reuses the longest cached prefix and only
the rest is prefilled (`trim_prompt_cache` cuts an entry back to the shared
part).

An entry covers a request's prompt and, for caches that can be trimmed, the
answer generated after it: the next turn usually carries that answer back,
and where the template renders it differently (a `<think>` block dropped),
the entry is cut back to the shared prefix, which still holds the whole
earlier prompt. Caches that cannot be trimmed (recurrent layers, a rotating
window that wrapped) are stored at the prompt's boundary instead and reused
only where all of an entry is a prefix of the new prompt.

Two tiers. Memory: a byte budget counted from the real arrays (beside the
model's estimate, so the cache never pushes a model that fits over the line),
least recently used out first (entries: cache_entries.py). Disk
(engine/cache/kv_files.py, its files kv_format.py): every turn
as it is made, so an engine restarted after a Metal abort at any moment
still answers the next turn from its cache -- a prompt's blocks once its
first token is out (`checkpoint`), the answer's right after the turn
(`store`): written behind, by the writer's thread, only the blocks that are
new. What cannot be cut into blocks (a rotating window, recurrent layers)
is written whole when it leaves memory, and when the engine goes idle.

The decisions, and the value the cache hands out (Fetched), are pure and
live in engine/cache/prompt_cache_policy.py; its figures are mlxd.reports'
PromptCacheReport, what /health reports; `PromptCache` is their I/O shell,
with its parts beside it: a turn's prefix handed out (cache_fetch.py), the
writes under way (cache_writes.py), the speeds a disk read is judged by
(disk_speeds.py), the reuse reports (reuse_reports.py). The worker thread
owns it: every MLX array here is created, read and freed on that thread,
between or inside its own jobs. Files are written by engine/cache/kv_writer.py's
thread from numpy views: of a block's own copy, or of a whole entry's arrays,
which stay alive until the worker collects the write (both counted as
`writing_bytes` while they are not an entry's).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

from mlxd.reports import PromptCacheReport

from . import cache_fetch
from .cache_entries import Entry, Writing
from .cache_writes import CacheWrites
from .disk_speeds import DiskSpeeds
from .kv_blocks import bytes_per_token, layer_layout
from .kv_files import KVFiles
from .kv_format import kv_nbytes
from .prompt_cache_policy import MIN_REUSE_TOKENS, NOT_CACHED, Fetched, entries_to_evict, written_to_drop
from .reuse import ApproxPolicy, Candidate, Reuse, choose_reuse, supersedes
from .reuse_reports import ReuseReports

log = logging.getLogger("mlxd.engine.cache.prompt_cache")


def kv_offset(kv: list[Any]) -> int | None:
    """Tokens an attention cache holds (None for caches that do not say)."""
    offsets = [c.offset for c in kv if hasattr(c, "offset")]
    return min(offsets) if offsets else None


def _never_fatal(default: Any = None):
    """A fault in the cache's own bookkeeping costs the cache, never the
    engine: it is logged, memory entries are dropped (they may be
    inconsistent) and the request goes on cold. A real MLX fault shows
    again in the generation itself, which is fatal there."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self: "PromptCache", *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception:  # noqa: BLE001
                log.exception("prompt cache: %s failed; dropping the memory entries", method.__name__)
                self.entries.clear()
                self.stats = replace(self.stats, errors=self.stats.errors + 1)
                self.publish()
                return default
        return guarded
    return wrap


class PromptCache:
    """Both tiers for the resident model; used from the worker thread only."""

    def __init__(self, enabled: bool, files: KVFiles | None, max_read_s: float,
                 approximate: ApproxPolicy | None = None) -> None:
        self.enabled = enabled
        self.files = files if enabled else None
        # The bytes it may keep beside the model and the requests running, from
        # the engine's memory ledger (engine/core/memory_ledger.py); None: no limit
        # but its own budget. It keeps within it itself: no caller shrinks it.
        self.room: Callable[[], int | None] = lambda: None
        self.max_read_s = max_read_s
        self.approximate = approximate  # None: exact reuse only (the default)
        self.model_key: str | None = None
        self.budget_bytes = 0
        self.generation_prompt = 0  # tokens the resident model's template adds to open an answer
        self.coarse_steps = False  # a turn's KV packed into a buffer of coarse steps (KVLayout.coarse_steps)
        self.entries: list[Entry] = []  # least recently used first
        self._names = itertools.count(1)
        self.reports = ReuseReports()  # what recent conversations reused, and why it stopped where it did
        # Measured speeds for the disk-read decision, kept beside the entries: an engine restarted after a
        # crash judges its first read by them.
        self.speeds = DiskSpeeds(self.files.folder if self.files is not None else None)
        self.writes = CacheWrites(self.files, self.speeds)  # writes under way, in order
        self.stats = PromptCacheReport(enabled=enabled, disk_enabled=self.files is not None)
        self.publish()

    # --- the resident model ---------------------------------------------
    @_never_fatal()
    def set_model(self, model_key: str | None, budget_bytes: int, generation_prompt: int = 0,
                  coarse_steps: bool = False) -> None:
        """The resident model changed: other models' entries leave memory
        (to disk), and this one's budget applies (`coarse_steps`: its KV layout's)."""
        self.generation_prompt = generation_prompt
        self.coarse_steps = coarse_steps
        if model_key == self.model_key:
            self.budget_bytes = budget_bytes
            return
        self._evict(len(self.entries))
        self.model_key = model_key
        self.budget_bytes = budget_bytes
        if self.files is not None and model_key is not None:
            self.files.forget_other_builds(model_key)
        self.publish()

    # --- a request ---------------------------------------------------------
    @_never_fatal(NOT_CACHED)
    def fetch(self, prompt: list[int], answer_room: int = 0, read_room: int = 0) -> Fetched:
        """The KV to continue `prompt` from, taken out of the cache (or a
        copy), with room for the rest of the prompt and `answer_room` more
        positions (the request's max_tokens: allocated once, engine/cache/kv_cache.py).
        A disk entry read becomes the request's own KV: it may be as large as
        the cache's budget or `read_room`, the bytes admission granted the
        request's KV for its prompt (a conversation larger than a squeezed
        cache comes back from disk rather than cold); before it is read, the
        cache gives up all but its room (what it may keep while the request
        runs: the ledger has counted the request), so the read never meets
        entries the request displaces; after the fetch it keeps within it."""
        return cache_fetch.fetch(self, prompt, answer_room, read_room)

    @_never_fatal()
    def store(self, covered: list[int], prompt_len: int, kv: list[Any], conversation: tuple[str, ...] = (),
              turn: Fetched = NOT_CACHED, echo: tuple[int, ...] = (), fit: bool = False) -> None:
        """Keep the KV of `covered` (a prompt, and what was generated after
        it) for later requests, as the latest turn of `turn`'s conversation;
        older entries leave for the budget and the room. `fit`: the KV is
        copied into arrays of just its length first (a request's were
        allocated for all its max_tokens); the copy is made while the request's
        arrays are alive, so the cache first gives up what both take."""
        if not self.enabled or self.model_key is None or not covered:
            return
        self.settle()
        if fit:
            from .kv_cache import fitted, fitted_bytes

            room = self.room_now()
            if room is not None:
                self.keep_within(max(0, room - kv_nbytes(kv) - fitted_bytes(kv)))
            kv = fitted(kv)
        tokens = np.asarray(covered, dtype=np.int32)
        entry = Entry(self.model_key, tokens, min(prompt_len, len(tokens)), kv, kv_nbytes(kv), conversation,
                      name=turn.name or self.new_name(), replaces=turn.replaces, echo=echo)
        kept = [e for e in self.entries if not supersedes(entry, e)]
        if len(kept) < len(self.entries):
            self.stats = replace(self.stats, superseded=self.stats.superseded + len(self.entries) - len(kept))
        self.entries = kept
        self.entries.append(entry)
        room = self.room_now()
        self._evict(entries_to_evict([e.nbytes for e in self.entries],
                                     self.budget_bytes if room is None else min(room, self.budget_bytes)))
        if any(e is entry for e in self.entries):  # (an entry evicted at once was written as it left)
            self._write_behind(entry.tokens, entry.prompt_len, entry.kv, entry.conversation, entry.echo, entry)
        self.publish()

    @_never_fatal()
    def checkpoint(self, covered: list[int], kv: list[Any], conversation: tuple[str, ...] = (),
                   prefilled: int = MIN_REUSE_TOKENS) -> Writing | None:
        """A prompt just prefilled (`kv` covers `covered`, and goes on growing
        past it; `prefilled` of its tokens were computed by this turn): its
        blocks to disk now, while the answer is decoded, so a crash at any
        moment costs at most the answer's KV -- the turn's own write, right
        after the answer, races a crash that comes at once, and usually loses
        (its fsyncs take milliseconds). It costs the answer about one decode
        step (the copy waits for the step under way; docs/BENCHMARKS.md), so
        not for a prompt that added less than MIN_REUSE_TOKENS. The write, for
        `written` and `await_write` (None: nothing to write)."""
        if self.files is None or self.model_key is None or prefilled < MIN_REUSE_TOKENS:
            return None
        self.settle()
        writing = self._write_behind(np.asarray(covered, dtype=np.int32), len(covered), kv, conversation, (), None)
        self.publish()
        return writing

    @_never_fatal(True)
    def written(self, writing: Writing) -> bool:
        """Whether this write is done (on disk, or given up): the finished
        writes collected, none waited for. A request's prompt, before its
        answer's end goes out, so that a crash the moment the answer arrives
        still finds it (engine/core/held_answers.py)."""
        self.settle()
        return writing not in self.writes.under_way

    @_never_fatal()
    def await_write(self, writing: Writing | None, limit_s: float) -> None:
        """Wait (at most `limit_s`) until this write is done: an answer's end
        held for its prompt where nothing else would run meanwhile."""
        if writing is not None and writing in self.writes.under_way:
            self.wait_for_writes(lambda: writing in self.writes.under_way, limit_s)
            self.publish()

    def _write_behind(self, tokens: np.ndarray, prompt_len: int, kv: list[Any], conversation: tuple[str, ...],
                      echo: tuple[int, ...], entry: Entry | None) -> Writing | None:
        """A turn's new blocks staged (copies: the KV may go on being written)
        and handed to the writer, if the cache has room for the copies
        beside its entries (else the entry goes to disk as it leaves memory)."""
        if self.files is None:
            return None
        layout = layer_layout(kv)
        if layout is None:
            # A layer that cannot be cut into blocks (rotating, state-space): the whole entry in one file, now
            # and behind, when the writer is free -- a crash right after the answer finds it (at idle, or as it
            # leaves memory, otherwise). A prompt's checkpoint has no entry to write yet.
            if entry is None or self.writes.under_way:
                return None
            self._write(entry, in_memory=True)
            return self.writes.of(entry)
        names = self.files.block_names(self.model_key, tokens, layout)
        copies = int(self.files.unwritten_tokens(tokens, names) * bytes_per_token(kv))
        room = self.room_now()
        limit = self.budget_bytes if room is None else min(room, self.budget_bytes)
        if copies + self.writes.held_bytes() > limit or not self._drop_written(limit - copies):
            # No room, or the disk is behind (a fast GPU prefill outruns it): never wait for it here (the worker
            # would hold every decoding row for the disk: 0.3-0.9 s a turn on the lent H100). The next
            # checkpoint, the turn's end or the entry's leaving memory writes what this would have.
            log.debug("prompt cache: no room for %d MiB of new blocks now; written later", copies >> 20)
            return None
        staged = self.files.stage(self.model_key, tokens, prompt_len, kv, conversation, echo, names)
        return self.writes.submit(staged, entry, in_memory=True)

    @_never_fatal()
    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A measured prefill, for the disk-read decision (disk_speeds.py)."""
        self.speeds.note_prefill(tokens, seconds)

    def room_now(self) -> int | None:
        room = self.room()
        return None if room is None else max(0, room)

    def keep_within(self, budget_bytes: int | None) -> None:
        """Least recently used entries leave memory (to disk) until the rest,
        with the entries still being written, take at most `budget_bytes`:
        room for a request's own KV, which must be there before it starts
        (so here, and only here, the worker waits for the writer)."""
        if budget_bytes is None or sum(e.nbytes for e in self.entries) + self.writes.held_bytes() <= budget_bytes:
            return
        self.settle()
        self._evict(entries_to_evict([e.nbytes for e in self.entries], budget_bytes))
        self.wait_for_writes(lambda: sum(e.nbytes for e in self.entries) + self.writes.held_bytes() > budget_bytes)
        self.publish()

    @_never_fatal()
    def finish_writes(self, still: Callable[[], bool] = lambda: True) -> None:
        """Every write under way finished and collected while `still()` holds
        (the writer goes on: an idle unload waits for its entries' writes, so
        their staged copies are freed before the memory is handed back)."""
        self.wait_for_writes(still)

    @_never_fatal()
    def flush(self) -> None:
        """Every write under way finished and collected, and the writer's thread
        ended (the engine stops: no thread is left writing as the process exits)."""
        self.wait_for_writes(lambda: True)
        self.writes.close()

    # --- between requests ----------------------------------------------------
    @_never_fatal()
    def idle(self) -> None:
        """The engine has nothing to do: write the latest entry to disk, so an
        engine restart does not lose the conversation in progress."""
        if self.files is None:
            return
        self.settle()
        if self.entries and self.entries[-1].file is None and self.writes.of(self.entries[-1]) is None:
            self._write(self.entries[-1], in_memory=True)
            self.publish()
        self.speeds.save()

    # --- for itself and its parts (cache_fetch.py) --------------------------------
    def plan(self, candidates: Sequence[Candidate], tokens: np.ndarray) -> Reuse | None:
        return choose_reuse(candidates, tokens, MIN_REUSE_TOKENS, self.generation_prompt, self.approximate)

    def new_name(self) -> str:
        return f"c{next(self._names)}"

    def disk_entries(self) -> int:
        return len(self.files.entries(self.model_key)) if self.files is not None else 0  # type: ignore[arg-type]

    def _drop_written(self, budget_bytes: int) -> bool:
        """Entries already on disk leave memory, least recently used first,
        until the rest and the writes under way fit `budget_bytes`; whether
        they do. Nothing staged, nothing waited for."""
        held = self.writes.held_bytes()
        drop = written_to_drop([e.nbytes for e in self.entries],
                               [e.file is not None and self.writes.of(e) is None for e in self.entries],
                               max(0, budget_bytes - held))
        if drop is None:
            return False
        if drop:
            leaving = set(drop)
            self.entries = [e for i, e in enumerate(self.entries) if i not in leaving]
            self.stats = replace(self.stats, evictions=self.stats.evictions + len(drop))
        return True

    def _evict(self, n: int) -> None:
        """The n least recently used entries leave memory, to disk first."""
        if n <= 0:
            return
        # The arrays are freed with the last reference (here, or once written: settle). Their buffers go
        # back to MLX's cache, which the worker bounds to the budget (worker._bound_mlx_memory): no
        # clear_cache() here, which is slow on a CUDA card (a sync, and every buffer allocated again;
        # docs/BENCHMARKS.md, "Why the engine is built as it is").
        leaving, self.entries = self.entries[:n], self.entries[n:]
        for entry in leaving:
            writing = self.writes.of(entry)
            if writing is not None:  # a write under way: a whole file's arrays go once it is done
                writing.entry = None
            elif self.files is not None and entry.file is None:
                self._write(entry, in_memory=False)
        self.stats = replace(self.stats, evictions=self.stats.evictions + len(leaving))

    def _write(self, entry: Entry, in_memory: bool) -> None:
        """The entry's files staged and handed to the writer (the I/O is its
        thread's: the worker goes on at once)."""
        assert self.files is not None
        staged = self.files.stage(entry.model_key, entry.tokens, entry.prompt_len, entry.kv, entry.conversation,
                                  entry.echo)
        self.writes.submit(staged, entry, in_memory)

    def settle(self, block: bool = False, timeout: float = 60.0) -> None:
        """Collects the writes the writer has finished (cache_writes.py), and publishes what changed."""
        if self.writes.collect(block, timeout):
            self.publish()

    def wait_for_writes(self, still: Callable[[], bool], limit_s: float = 120.0) -> None:
        """Collect finished writes, waiting for them, while `still()` holds
        and writes are under way (at most `limit_s`: a disk that hangs costs
        the disk tier, not the engine)."""
        began = time.monotonic()
        deadline = began + limit_s
        waited = False
        while self.writes.pending and still() and time.monotonic() < deadline:
            waited = True
            self.settle(block=True, timeout=max(0.0, deadline - time.monotonic()))
        if waited:  # where the worker (and every decoding row) waited for the disk
            log.debug("prompt cache: waited %.0f ms for the writer", 1000 * (time.monotonic() - began))

    def publish(self) -> None:
        s = replace(self.stats, model=self.model_key, memory_entries=len(self.entries), recent=self.reports.lines(),
                    hit_rate=round(self.stats.cached_tokens / self.stats.prompt_tokens, 4) if self.stats.prompt_tokens else 0.0,
                    memory_bytes=sum(e.nbytes for e in self.entries), memory_budget_bytes=self.budget_bytes,
                    writing_bytes=self.writes.held_bytes(), disk_writes_pending=len(self.writes.under_way),
                    disk_writes=self.writes.done, disk_write_failures=self.writes.failed)
        if self.files is not None:
            s = replace(s, disk_entries=self.files.count, disk_bytes=self.files.total_bytes,
                        disk_budget_bytes=self.files.budget_bytes, disk_rejects=self.files.rejected)
        self.stats = s
