"""The speeds the prompt cache's disk-read decision is judged by: the disk's
read speed and the prefill's, measured, and kept beside the entries
(kv/rates.json), so an engine restarted after a crash judges its first read
by them (engine/cache/prompt_cache_policy.py decides; this keeps the figures).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mlxd.paths import write_atomic

from .prompt_cache_policy import MIN_PREFILL_SAMPLE, prefill_rate_for, worth_reading

log = logging.getLogger("mlxd.engine.cache.prompt_cache")

RATES_FILE = "rates.json"  # in the disk tier's folder, beside the entries (engine/cache/kv_files.py skips it)
MIN_SPEED_SAMPLE_BYTES = 4 * 2**20  # a write that tells the disk's speed (a turn's new blocks are often less)


def load_rates(folder: Path) -> dict[str, float]:
    try:
        rates = json.loads((folder / RATES_FILE).read_text())
        return {k: float(v) for k, v in rates.items() if isinstance(v, (int, float)) and v > 0}
    except (OSError, ValueError, AttributeError):
        return {}


def save_rates(folder: Path, rates: dict[str, float | None]) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / RATES_FILE, json.dumps(rates), durable=False)
    except OSError as exc:
        log.warning("prompt cache: cannot save measured speeds: %s", exc)


class DiskSpeeds:
    """The measured speeds (worker thread only); `folder`: where they are
    kept (None: no disk tier, nothing kept)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        rates = load_rates(folder) if folder is not None else {}
        self.read_bytes_per_s = float(rates.get("read_bytes_per_s") or 1e9)  # until measured
        self.prefill_tokens_per_s: float | None = rates.get("prefill_tokens_per_s")  # fastest seen
        self.first_prefill_tokens_per_s: float | None = rates.get("first_prefill_tokens_per_s")
        self.warm = False  # this process has prefilled a long prompt
        self.read_measured = bool(rates.get("read_measured"))
        self._saved = dict(rates)

    def worth_reading(self, nbytes: int, saved_tokens: int, max_bytes: int, max_read_s: float) -> bool:
        """Whether reading `nbytes` from disk beats prefilling the tokens it
        saves, by the speeds measured (prompt_cache_policy.worth_reading)."""
        return worth_reading(nbytes, saved_tokens, max_bytes=max_bytes, max_read_s=max_read_s,
                             read_bytes_per_s=self.read_bytes_per_s, read_timed=self.read_measured,
                             prefill_tokens_per_s=prefill_rate_for(self.warm, self.prefill_tokens_per_s,
                                                                   self.first_prefill_tokens_per_s))

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A measured prefill: the fastest seen over long prompts (short ones
        are mostly fixed costs), so a read is chosen only where it beats the
        prefill at its best."""
        if tokens >= MIN_PREFILL_SAMPLE and seconds > 0:
            rate = tokens / seconds
            self.prefill_tokens_per_s = max(self.prefill_tokens_per_s or 0.0, rate)
            if not self.warm:  # this process's first: what a restarted engine's prefill costs
                self.first_prefill_tokens_per_s = rate
                self.warm = True

    def note_read(self, nbytes: int, seconds: float) -> None:
        """A read, timed (a fast one too: otherwise the estimate only ever learns from slow reads)."""
        measured = nbytes / seconds
        self.read_bytes_per_s = (0.7 * self.read_bytes_per_s + 0.3 * measured) if self.read_measured else measured
        self.read_measured = True

    def note_write(self, nbytes: int, seconds: float) -> None:
        """A write, timed by the writer (not its wait in the queue): with no
        read timed yet, this disk's write speed is the best guess (a slow or
        virtualised disk reads slowly too), not an optimistic default; only
        writes large enough that the fsyncs' fixed cost does not pass for a
        slow disk."""
        if not self.read_measured and nbytes >= MIN_SPEED_SAMPLE_BYTES and seconds > 0:
            self.read_bytes_per_s = nbytes / seconds

    def save(self) -> None:
        """Kept beside the entries, where they changed."""
        rates = {"read_bytes_per_s": self.read_bytes_per_s, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                 "first_prefill_tokens_per_s": self.first_prefill_tokens_per_s,
                 "read_measured": 1.0 if self.read_measured else None}
        if self.folder is not None and rates != self._saved:
            save_rates(self.folder, rates)
            self._saved = rates
