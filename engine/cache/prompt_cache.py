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
least recently used out first. Disk (engine/cache/kv_files.py): every turn
as it is made, so an engine restarted after a Metal abort at any moment
still answers the next turn from its cache -- a prompt's blocks once its
first token is out (`checkpoint`), the answer's right after the turn
(`store`): written behind, by the writer's thread, only the blocks that are
new. What cannot be cut into blocks (a rotating window, recurrent layers)
is written whole when it leaves memory, and when the engine goes idle.

The decisions, and the value the cache hands out (Fetched), are
pure and live in engine/cache/prompt_cache_policy.py; its figures are mlxd.reports'
PromptCacheReport, what /health reports; `PromptCache` is their I/O
shell. The worker thread owns it: every MLX array here is created, read and
freed on that thread, between or inside its own jobs. Files are written by
engine/cache/kv_writer.py's thread from numpy views: of a block's own copy,
or of a whole entry's arrays, which stay alive until the worker collects the
write (both counted as `writing_bytes` while they are not an entry's).
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from mlxd.reports import PromptCacheReport, ReuseLine

from .kv_blocks import bytes_per_token, layer_layout
from .kv_files import DiskEntry, KVFileError, KVFiles, is_patchable, kv_nbytes
from .kv_writer import KVWriter, StagedWrite
from .prompt_cache_policy import (MIN_PREFILL_SAMPLE, MIN_REUSE_TOKENS, NOT_CACHED, Fetched,
                                  entries_to_evict, prefill_rate_for, worth_reading)
from .reuse import ApproxPolicy, Candidate, Reuse, choose_reuse, explain, supersedes

log = logging.getLogger("mlxd.engine.cache.prompt_cache")

RECENT_CONVERSATIONS = 8  # reports kept for status and /metrics
MIN_SPEED_SAMPLE_BYTES = 4 * 2**20  # a write that tells the disk's speed (a turn's new blocks are often less)
EXCERPT_TOKENS = 12  # each side of where reuse stopped, in the debug log


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
        return _trimmable(self.kv)

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


def _trimmable(kv: list[Any]) -> bool:
    from mlx_lm.models.cache import can_trim_prompt_cache

    return bool(kv) and can_trim_prompt_cache(kv)


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
                self._entries.clear()
                self.stats = replace(self.stats, errors=self.stats.errors + 1)
                self._publish()
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
        self._entries: list[Entry] = []  # least recently used first
        self._writer = KVWriter(self.files.before_commit) if self.files is not None else None
        self._writing: list[Writing] = []  # writes under way, in order
        self._names = itertools.count(1)
        self._recent: OrderedDict[str, ReuseLine] = OrderedDict()  # by conversation, newest last
        # Measured speeds for the disk-read decision, kept beside the entries:
        # an engine restarted after a crash judges its first read by them.
        rates = self.files.load_rates() if self.files is not None else {}
        self._read_bytes_per_s = float(rates.get("read_bytes_per_s") or 1e9)  # until measured
        self._prefill_tokens_per_s: float | None = rates.get("prefill_tokens_per_s")  # fastest seen
        self._first_prefill_tokens_per_s: float | None = rates.get("first_prefill_tokens_per_s")
        self._warm = False  # this process has prefilled a long prompt
        self._read_measured = bool(rates.get("read_measured"))
        self._rates_saved = dict(rates)
        self.stats = PromptCacheReport(enabled=enabled, disk_enabled=self.files is not None)
        self._publish()

    # --- the resident model ---------------------------------------------
    @_never_fatal()
    def set_model(self, model_key: str | None, budget_bytes: int, generation_prompt: int = 0) -> None:
        """The resident model changed: other models' entries leave memory
        (to disk), and this one's budget applies."""
        self.generation_prompt = generation_prompt
        if model_key == self.model_key:
            self.budget_bytes = budget_bytes
            return
        self._evict(len(self._entries))
        self.model_key = model_key
        self.budget_bytes = budget_bytes
        if self.files is not None and model_key is not None:
            self.files.forget_other_builds(model_key)
        self._publish()

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
        if not self.enabled or self.model_key is None:
            return NOT_CACHED
        self._settle()
        tokens = np.asarray(prompt, dtype=np.int32)
        in_memory = self._plan(self._entries, tokens)
        self._await_writes_that_serve(tokens, in_memory.reused if in_memory else 0)
        fetched = None
        if self.files is not None and (in_memory is None or in_memory.tokens < len(tokens) - 1):
            fetched = self._fetch_from_disk(tokens, in_memory.reused if in_memory else 0, answer_room, read_room)
        if fetched is None and in_memory is not None:
            fetched = self._take(in_memory, tokens, answer_room)
        if fetched is None:
            fetched = Fetched(None, 0, 0, "none", name=self._new_name())
            stopped, why = explain(None, None, len(tokens), len(self._entries) + self._disk_entries())
            self._report(ReuseLine(fetched.name, len(tokens), 0, stopped, why))
        s = self.stats
        self.stats = replace(s, requests=s.requests + 1, hits=s.hits + (fetched.cached_tokens > 0),
                             disk_hits=s.disk_hits + (fetched.source == "disk"),
                             prompt_tokens=s.prompt_tokens + len(prompt),
                             cached_tokens=s.cached_tokens + fetched.cached_tokens,
                             recomputed_tokens=s.recomputed_tokens + sum(b - a for a, b in fetched.patches))
        self._keep_within(self._room_now())
        self._publish()
        return fetched

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
        self._settle()
        if fit:
            from .kv_cache import fitted, fitted_bytes

            room = self._room_now()
            if room is not None:
                self._keep_within(max(0, room - kv_nbytes(kv) - fitted_bytes(kv)))
            kv = fitted(kv)
        tokens = np.asarray(covered, dtype=np.int32)
        entry = Entry(self.model_key, tokens, min(prompt_len, len(tokens)), kv, kv_nbytes(kv), conversation,
                      name=turn.name or self._new_name(), replaces=turn.replaces, echo=echo)
        kept = [e for e in self._entries if not supersedes(entry, e)]
        if len(kept) < len(self._entries):
            self.stats = replace(self.stats, superseded=self.stats.superseded + len(self._entries) - len(kept))
        self._entries = kept
        self._entries.append(entry)
        room = self._room_now()
        self._evict(entries_to_evict([e.nbytes for e in self._entries],
                                     self.budget_bytes if room is None else min(room, self.budget_bytes)))
        if any(e is entry for e in self._entries):  # (an entry evicted at once was written as it left)
            self._write_behind(entry.tokens, entry.prompt_len, entry.kv, entry.conversation, entry.echo, entry)
        self._publish()

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
        self._settle()
        writing = self._write_behind(np.asarray(covered, dtype=np.int32), len(covered), kv, conversation, (), None)
        self._publish()
        return writing

    @_never_fatal(True)
    def written(self, writing: Writing) -> bool:
        """Whether this write is done (on disk, or given up): the finished
        writes collected, none waited for. A request's prompt, before its
        answer's end goes out, so that a crash the moment the answer arrives
        still finds it (engine/core/held_answers.py)."""
        self._settle()
        return writing not in self._writing

    @_never_fatal()
    def await_write(self, writing: Writing | None, limit_s: float) -> None:
        """Wait (at most `limit_s`) until this write is done: an answer's end
        held for its prompt where nothing else would run meanwhile."""
        if writing is not None and writing in self._writing:
            self._wait_for_writes(lambda: writing in self._writing, limit_s)
            self._publish()

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
            if entry is None or self._writing:
                return None
            self._write(entry, in_memory=True)
            return self._writing_of(entry)
        names = self.files.block_names(self.model_key, tokens, layout)
        copies = int(self.files.unwritten_tokens(tokens, names) * bytes_per_token(kv))
        room = self._room_now()
        limit = self.budget_bytes if room is None else min(room, self.budget_bytes)
        if copies + self._writing_bytes() > limit:
            # No room, or the disk is behind (a fast GPU prefill outruns it): never wait for it here.
            # The next checkpoint, the turn's end or the entry's leaving memory writes what this would have.
            log.debug("prompt cache: no room for %d MiB of new blocks now; written later", copies >> 20)
            return None
        self._keep_within(limit - copies)  # (entries only leave: what is being written fits beside the copies)
        if entry is not None and not any(e is entry for e in self._entries):
            return None  # it left memory to make the room, and was written as it left
        return self._submit(self.files.stage(self.model_key, tokens, prompt_len, kv, conversation, echo, names), entry,
                            in_memory=True)

    @_never_fatal()
    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A measured prefill, for the disk-read decision: the fastest seen
        over long prompts (short ones are mostly fixed costs), so a read is
        chosen only where it beats the prefill at its best."""
        if tokens >= MIN_PREFILL_SAMPLE and seconds > 0:
            rate = tokens / seconds
            self._prefill_tokens_per_s = max(self._prefill_tokens_per_s or 0.0, rate)
            if not self._warm:  # this process's first: what a restarted engine's prefill costs
                self._first_prefill_tokens_per_s = rate
                self._warm = True

    def _room_now(self) -> int | None:
        room = self.room()
        return None if room is None else max(0, room)

    def _keep_within(self, budget_bytes: int | None) -> None:
        """Least recently used entries leave memory (to disk) until the rest,
        with the entries still being written, take at most `budget_bytes`:
        room for a request's own KV, which must be there before it starts
        (so here, and only here, the worker waits for the writer)."""
        if budget_bytes is None or sum(e.nbytes for e in self._entries) + self._writing_bytes() <= budget_bytes:
            return
        self._settle()
        self._evict(entries_to_evict([e.nbytes for e in self._entries], budget_bytes))
        self._wait_for_writes(lambda: sum(e.nbytes for e in self._entries) + self._writing_bytes() > budget_bytes)
        self._publish()

    @_never_fatal()
    def finish_writes(self, still: Callable[[], bool] = lambda: True) -> None:
        """Every write under way finished and collected while `still()` holds
        (the writer goes on: an idle unload waits for its entries' writes, so
        their staged copies are freed before the memory is handed back)."""
        self._wait_for_writes(still)

    @_never_fatal()
    def flush(self) -> None:
        """Every write under way finished and collected, and the writer's thread
        ended (the engine stops: no thread is left writing as the process exits)."""
        self._wait_for_writes(lambda: True)
        if self._writer is not None:
            self._writer.close()

    # --- between requests ----------------------------------------------------
    @_never_fatal()
    def idle(self) -> None:
        """The engine has nothing to do: write the latest entry to disk, so an
        engine restart does not lose the conversation in progress."""
        if self.files is None:
            return
        self._settle()
        if self._entries and self._entries[-1].file is None and self._writing_of(self._entries[-1]) is None:
            self._write(self._entries[-1], in_memory=True)
            self._publish()
        self._save_rates()

    def _save_rates(self) -> None:
        """The measured speeds go with the entries (saved where they changed):
        an engine restarted after a crash judges its first read by them."""
        rates = {"read_bytes_per_s": self._read_bytes_per_s, "prefill_tokens_per_s": self._prefill_tokens_per_s,
                 "first_prefill_tokens_per_s": self._first_prefill_tokens_per_s,
                 "read_measured": 1.0 if self._read_measured else None}
        if self.files is not None and rates != self._rates_saved:
            self.files.save_rates(rates)
            self._rates_saved = rates

    # --- internals -------------------------------------------------------------
    def _plan(self, candidates: Sequence[Candidate], tokens: np.ndarray) -> Reuse | None:
        return choose_reuse(candidates, tokens, MIN_REUSE_TOKENS, self.generation_prompt, self.approximate)

    def _take(self, reuse: Reuse, tokens: np.ndarray, answer_room: int) -> Fetched:
        from mlx_lm.models.cache import KVCache, QuantizedKVCache, trim_prompt_cache

        from .kv_cache import packed

        entry = self._entries[reuse.index]
        writing = self._writing_of(entry)
        if writing is not None:
            writing.entry = None  # the turn holds it now: the write's views (if any) count as held
        if reuse.copy:
            # Cut a copy, not the entry. A plain KVCache's trim only moves its offset,
            # so a shallow copy can be cut and then packed into arrays of its own;
            # other layers write into their arrays in place and are deep-copied.
            kv = [copy.copy(c) if isinstance(c, (KVCache, QuantizedKVCache)) else copy.deepcopy(c) for c in entry.kv]
            self._entries.remove(entry)
            self._entries.append(entry)  # used: most recent now
            name, replaces = self._new_name(), ()
        else:
            kv = entry.kv
            self._entries.remove(entry)  # continued by this turn, which replaces it
            self.stats = replace(self.stats, superseded=self.stats.superseded + 1)
            name, replaces = entry.name, entry.replaces + ((entry.file,) if entry.file is not None else ())
        fetched = self._fetched(reuse, entry, tokens, kv, "memory", name, replaces)
        if reuse.trim:
            trim_prompt_cache(kv, reuse.trim)
        # A whole file still being written reads the entry's arrays: the turn must not write into them.
        shared = reuse.copy or (writing is not None and writing.views_entry)
        return replace(fetched, kv=packed(kv, len(tokens) - reuse.tokens + answer_room, shared=shared))

    def _fetched(self, reuse: Reuse, found: Candidate, tokens: np.ndarray, kv: list[Any], source: str, name: str,
                 replaces: tuple[DiskEntry, ...]) -> Fetched:
        """The turn's Fetched and its report (before the entry is trimmed)."""
        stopped, why = explain(reuse, found, len(tokens), 0)
        excerpt = None
        if stopped is not None:
            lo = max(stopped - EXCERPT_TOKENS, 0)
            excerpt = (found.tokens[lo:stopped + EXCERPT_TOKENS].tolist(), tokens[lo:stopped + EXCERPT_TOKENS].tolist())
        self._report(ReuseLine(name, len(tokens), reuse.reused, stopped, why, reuse.recomputed, source))
        return Fetched(kv, reuse.tokens, reuse.reused, source, reuse.patches, name, replaces, excerpt)

    def _fetch_from_disk(self, tokens: np.ndarray, memory_tokens: int, answer_room: int,
                         read_room: int) -> Fetched | None:
        """A disk entry that saves more than memory does, read if worth it."""
        assert self.files is not None
        candidates = self.files.entries(self.model_key)  # type: ignore[arg-type]
        reuse = self._plan(candidates, tokens)
        if reuse is None or reuse.reused <= memory_tokens:
            return None
        found = candidates[reuse.index]
        room = max(self.budget_bytes, read_room, 0)
        if not worth_reading(found.nbytes, reuse.reused - memory_tokens, max_bytes=room,
                             max_read_s=self.max_read_s, read_bytes_per_s=self._read_bytes_per_s,
                             read_timed=self._read_measured,
                             prefill_tokens_per_s=prefill_rate_for(self._warm, self._prefill_tokens_per_s,
                                                                   self._first_prefill_tokens_per_s)):
            log.info("prompt cache: not reading %s (%d MiB): slower than the prefill it saves or over the "
                     "room for it", found.path.name, found.nbytes >> 20)
            return None
        self._keep_within(self._room_now())
        started = time.monotonic()
        try:
            kv = self.files.load(found)
        except KVFileError as exc:
            log.warning("prompt cache: %s; removed", exc)
            return None
        # Every read is timed (a fast one too: otherwise the estimate only ever learns from slow reads).
        elapsed = max(time.monotonic() - started, 1e-6)
        measured = found.nbytes / elapsed
        self._read_bytes_per_s = (0.7 * self._read_bytes_per_s + 0.3 * measured) if self._read_measured \
            else measured
        self._read_measured = True
        log.info("prompt cache: read %d tokens from disk in %.3fs", len(found.tokens), elapsed)
        # A disk entry is read into memory: the file stays for other branches unless this turn continues it.
        fetched = self._fetched(reuse, found, tokens, kv, "disk", self._new_name(), () if reuse.copy else (found,))
        if reuse.trim:
            from mlx_lm.models.cache import trim_prompt_cache

            trim_prompt_cache(kv, reuse.trim)
        from .kv_cache import packed

        return replace(fetched, kv=packed(kv, len(tokens) - reuse.tokens + answer_room))

    def _new_name(self) -> str:
        return f"c{next(self._names)}"

    def _disk_entries(self) -> int:
        return len(self.files.entries(self.model_key)) if self.files is not None else 0  # type: ignore[arg-type]

    def _report(self, report: ReuseLine) -> None:
        self._recent.pop(report.conversation, None)
        self._recent[report.conversation] = report
        while len(self._recent) > RECENT_CONVERSATIONS:
            self._recent.popitem(last=False)

    def _evict(self, n: int) -> None:
        """The n least recently used entries leave memory, to disk first."""
        if n <= 0:
            return
        # The arrays are freed with the last reference (here, or once written: _settle). Their buffers go
        # back to MLX's cache, which the worker bounds to the budget (worker._bound_mlx_memory): no
        # clear_cache() here, which is slow on a CUDA card (a sync, and every buffer allocated again;
        # docs/BENCHMARKS.md, "Why the engine is built as it is").
        leaving, self._entries = self._entries[:n], self._entries[n:]
        for entry in leaving:
            writing = self._writing_of(entry)
            if writing is not None:  # a write under way: a whole file's arrays go once it is done
                writing.entry = None
            elif self.files is not None and entry.file is None:
                self._write(entry, in_memory=False)
        self.stats = replace(self.stats, evictions=self.stats.evictions + len(leaving))

    def _write(self, entry: Entry, in_memory: bool) -> None:
        """The entry's files staged and handed to the writer (the I/O is its
        thread's: the worker goes on at once)."""
        assert self.files is not None
        self._submit(self.files.stage(entry.model_key, entry.tokens, entry.prompt_len, entry.kv, entry.conversation,
                                      entry.echo), entry, in_memory)

    def _submit(self, staged: StagedWrite | None, entry: Entry | None, in_memory: bool) -> Writing | None:
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
        self._writing.append(writing)
        self._writer.submit(staged)
        log.debug("prompt cache: staged %d file(s), %d MiB", len(staged.files), staged.nbytes >> 20)
        return writing

    def _writing_of(self, entry: Entry) -> Writing | None:
        return next((w for w in self._writing if w.entry is entry), None)

    def _settle(self, block: bool = False, timeout: float = 60.0) -> None:
        """Collects the writes the writer has finished: their files into the
        index, the arrays of evicted entries freed (here, on the worker)."""
        if self._writer is None or not self._writer.pending:
            return
        done = self._writer.finished(block=block, timeout=timeout)
        for staged in done:
            staged.drop_views()  # the views of MLX arrays, dropped on this thread
            writing: Writing = staged.token
            staged.token = None  # no cycle left between the two: the entry's arrays go when nothing else holds them
            self._writing.remove(writing)
            if staged.error is not None:  # a full disk costs the disk tier, never a request
                log.warning("prompt cache: cannot write an entry: %s", staged.error)
                self.stats = replace(self.stats, disk_write_failures=self.stats.disk_write_failures + 1)
                self.files.abandon(staged)  # type: ignore[union-attr]
                continue
            written = self.files.commit(staged)  # type: ignore[union-attr]
            if written is not None:
                self._written(writing, written)
        if done:
            self._save_rates()  # beside the entries just written (a write may have measured the disk)
            self._publish()

    def _written(self, writing: Writing, written: DiskEntry) -> None:
        assert self.files is not None
        if writing.entry is not None:
            writing.entry.file = written
        self.stats = replace(self.stats, disk_writes=self.stats.disk_writes + 1)
        # Earlier turns of its conversation only take room now (a file of the same tokens is this one).
        self.files.delete(d for d in writing.replaces if d.path != written.path)
        # Files this one extends (or, with agent-safe keys, a later turn of) only take room now.
        self.files.delete_where(lambda d: d is not written and d.model_key == written.model_key
                                and supersedes(written, d))
        staged = writing.staged
        if not self._read_measured and staged.nbytes >= MIN_SPEED_SAMPLE_BYTES and staged.seconds > 0:
            # No read timed yet: this disk's write speed is the best guess (a slow
            # or virtualised disk reads slowly too), not an optimistic default. Timed
            # by the writer (not the wait in its queue), over writes large enough
            # that the fsyncs' fixed cost does not pass for a slow disk.
            self._read_bytes_per_s = staged.nbytes / staged.seconds

    def _writing_bytes(self) -> int:
        return sum(w.held_bytes for w in self._writing)

    def _await_writes_that_serve(self, tokens: np.ndarray, reused: int) -> None:
        """An entry being written, not in memory, that would serve this prompt
        better than memory does: wait for its file (then read as any other)."""
        away = [w for w in self._writing if w.entry is None]
        if not away:
            return
        best = self._plan([w.staged.disk_entry for w in away], tokens)
        if best is not None and best.reused > reused:
            wanted = away[best.index]
            self._wait_for_writes(lambda: wanted in self._writing)

    def _wait_for_writes(self, still: Callable[[], bool], limit_s: float = 120.0) -> None:
        """Collect finished writes, waiting for them, while `still()` holds
        and writes are under way (at most `limit_s`: a disk that hangs costs
        the disk tier, not the engine)."""
        deadline = time.monotonic() + limit_s
        while self._writer is not None and self._writer.pending and still() and time.monotonic() < deadline:
            self._settle(block=True, timeout=max(0.0, deadline - time.monotonic()))

    def _publish(self) -> None:
        s = replace(self.stats, model=self.model_key, memory_entries=len(self._entries), recent=list(self._recent.values()),
                    hit_rate=round(self.stats.cached_tokens / self.stats.prompt_tokens, 4) if self.stats.prompt_tokens else 0.0,
                    memory_bytes=sum(e.nbytes for e in self._entries), memory_budget_bytes=self.budget_bytes,
                    writing_bytes=self._writing_bytes(), disk_writes_pending=len(self._writing))
        if self.files is not None:
            s = replace(s, disk_entries=self.files.count, disk_bytes=self.files.total_bytes,
                        disk_budget_bytes=self.files.budget_bytes, disk_rejects=self.files.rejected)
        self.stats = s
