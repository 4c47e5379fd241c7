"""Durations as Ollama (Go) writes them, for settings and requests that take
one (keep_alive): "5m", "1h30m", "90s", "500ms", or a number of seconds; a
negative one is "never" (pure)."""

from __future__ import annotations

import math
import re

NEVER = math.inf
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(value: str | int | float) -> float:
    """Seconds for a keep_alive (NEVER for a negative one); ValueError for
    anything else."""
    if isinstance(value, bool):
        raise ValueError("a duration, not a boolean")
    if isinstance(value, (int, float)):
        if math.isnan(value):
            raise ValueError("a duration, not NaN")
        return NEVER if value < 0 else float(value)
    text = value.strip()
    try:
        return parse_duration(float(text))  # "300", "-1": seconds, as Ollama reads a bare number
    except ValueError:
        pass
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    if not body or _PART.sub("", body):
        raise ValueError(f"{value!r} is not a duration (e.g. \"5m\", \"1h30m\", \"90s\", 300, -1 for never)")
    seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(body))
    return NEVER if sign < 0 and seconds > 0 else seconds


def describe(seconds: float) -> str:
    """A keep_alive for people: "never", "0 s", "90 s", "5 min", "1 h 30 min"."""
    if seconds == NEVER:
        return "never"
    if seconds < 120:
        return f"{seconds:g} s"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes} min" if hours and minutes else f"{hours} h" if hours else f"{minutes} min"
