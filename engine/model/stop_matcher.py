"""Stop sequences over streamed text.

Text arrives in pieces; a stop string may straddle pieces. The matcher emits
only text that cannot be the start of a stop string and holds back the rest
until the next piece decides it. Pure (no I/O), one per request.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic's answer names it)

    def feed(self, piece: str) -> str:
        """Add generated text; return the text that is safe to emit now."""
        if self.stopped:
            return ""
        text = self._held + piece
        if not self.stops:
            self._held = ""
            return text
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])  # the first to occur; on a tie, the first listed
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: whatever was held back is plain text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
