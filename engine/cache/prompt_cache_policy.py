"""The prompt cache's pure half (engine/cache/prompt_cache.py is its I/O shell):
the decisions -- which entries leave memory for the budget, whether a disk
entry is worth reading rather than prefilling, which entries must be kept at
the prompt's boundary -- and the values the cache hands out: `Fetched` (a
prompt's reuse, to the worker); its figures are mlxd.reports'
PromptCacheReport, what /health reports. No MLX here: tested as tables (tests/engine/test_prompt_cache_decisions.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from .kv_format import DiskEntry

# Tokens of the cached prefix handed to logits processors (repetition,
# presence and frequency penalties look back 20 tokens in mlx-lm): with them a
# request with penalties samples the same with and without the cache.
PROCESSOR_CONTEXT = 256
# Shorter shared prefixes are not reused: every conversation shares its chat
# template's opening tokens, and continuing another conversation's entry
# for them would cost a copy of it.
MIN_REUSE_TOKENS = 32
MIN_PREFILL_SAMPLE = 512  # prompt tokens a prefill must have to measure its speed by


def entries_to_evict(sizes_lru_first: Sequence[int], budget_bytes: int) -> int:
    """How many entries, least recently used first, must leave for the rest
    to fit the budget (pure)."""
    total = sum(sizes_lru_first)
    n = 0
    while total > budget_bytes and n < len(sizes_lru_first):
        total -= sizes_lru_first[n]
        n += 1
    return n


def written_to_drop(sizes_lru_first: Sequence[int], on_disk: Sequence[bool], budget_bytes: int) -> list[int] | None:
    """Which entries, least recently used first, to drop from memory for the
    rest to fit the budget, taking only entries already on disk (pure): they
    leave at once, with no write to wait for. None where those are not enough."""
    total, out = sum(sizes_lru_first), []
    for i, (size, written) in enumerate(zip(sizes_lru_first, on_disk)):
        if total <= budget_bytes:
            break
        if written:
            total -= size
            out.append(i)
    return out if total <= budget_bytes else None


def worth_reading(file_bytes: int, tokens_saved: int, *, max_bytes: int, max_read_s: float,
                  read_bytes_per_s: float, read_timed: bool, prefill_tokens_per_s: float | None) -> bool:
    """Whether to read a disk entry (pure): it must fit the memory the cache
    may use, be read within max_read_s at the disk's speed, and, once a read
    has been timed, be quicker to read than the prefill it saves. Before
    that the speed is the write speed, a guess: a file written moments
    before a crash is usually still in the OS's page cache, and an estimate
    that forbade the first read would never be corrected."""
    if file_bytes > max_bytes:
        return False
    read_s = file_bytes / max(read_bytes_per_s, 1.0)
    if read_s > max_read_s:
        return False
    if not read_timed or prefill_tokens_per_s is None:
        return True
    return read_s < tokens_saved / max(prefill_tokens_per_s, 1e-9)


def prefill_rate_for(warm: bool, fastest: float | None, first_in_process: float | None) -> float | None:
    """The prefill speed a disk read competes with (pure). An engine that has
    not prefilled a long prompt yet pays for its kernels' first compilation
    too (on MLX CUDA several times a warm prefill: docs/BENCHMARKS.md, "Why
    the engine is built as it is"): judged by earlier engines' first
    prefills, it reads where a read really is quicker for it."""
    if warm:
        return fastest
    return first_in_process or fastest


def needs_boundary_snapshot(layer_kinds: Sequence[str], trimmable: bool) -> bool:
    """Whether an entry must be snapshotted at the prompt's boundary (pure):
    a cache that cannot be trimmed now, or a rotating window that may wrap
    during the answer and stop being trimmable."""
    return not trimmable or any(kind == "RotatingKVCache" for kind in layer_kinds)


@dataclass(frozen=True)
class Fetched:
    """A prompt's reuse: the KV to continue (None: start cold), the prompt
    token the prefill starts at, and the spans to recompute first
    (approximate reuse). The turn's entry is stored under `name`, replacing
    `replaces` on disk."""

    kv: list[Any] | None
    start: int
    cached_tokens: int  # KV reused, recomputed spans not counted (usage's cached_tokens)
    source: str  # "memory", "disk" or "none"
    patches: tuple[tuple[int, int], ...] = ()
    name: str = ""
    replaces: tuple[DiskEntry, ...] = ()
    excerpt: tuple[list[int], list[int]] | None = None  # tokens around where reuse stopped: cached, prompt


NOT_CACHED = Fetched(None, 0, 0, "none")
