"""What each recent conversation reused, and where and why reuse stopped:
the prompt cache's reports for status and /metrics (mlxd.reports' ReuseLine),
made as a turn's KV is handed out (`fetched`), with the tokens on each side
of where it stopped for the debug log."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from mlxd.reports import ReuseLine

from .kv_format import DiskEntry
from .prompt_cache_policy import Fetched
from .reuse import Candidate, Reuse, explain

RECENT_CONVERSATIONS = 8  # reports kept for status and /metrics
EXCERPT_TOKENS = 12  # each side of where reuse stopped, in the debug log


class ReuseReports:
    """The latest report of each recent conversation, newest last (worker thread only)."""

    def __init__(self) -> None:
        self._recent: OrderedDict[str, ReuseLine] = OrderedDict()  # by conversation

    def lines(self) -> list[ReuseLine]:
        return list(self._recent.values())

    def add(self, report: ReuseLine) -> None:
        self._recent.pop(report.conversation, None)
        self._recent[report.conversation] = report
        while len(self._recent) > RECENT_CONVERSATIONS:
            self._recent.popitem(last=False)

    def fetched(self, reuse: Reuse, found: Candidate, tokens: np.ndarray, kv: list[Any], source: str, name: str,
                replaces: tuple[DiskEntry, ...]) -> Fetched:
        """The turn's Fetched and its report (before the entry is trimmed)."""
        stopped, why = explain(reuse, found, len(tokens), 0)
        excerpt = None
        if stopped is not None:
            lo = max(stopped - EXCERPT_TOKENS, 0)
            excerpt = (found.tokens[lo:stopped + EXCERPT_TOKENS].tolist(), tokens[lo:stopped + EXCERPT_TOKENS].tolist())
        self.add(ReuseLine(name, len(tokens), reuse.reused, stopped, why, reuse.recomputed, source))
        return Fetched(kv, reuse.tokens, reuse.reused, source, reuse.patches, name, replaces, excerpt)
