"""Polling with a deadline: the way tests and benchmarks wait for a condition
(never a bare sleep)."""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, interval: float = 0.05,
             stop: threading.Event | None = None) -> T | None:
    """Poll `condition` until it returns something truthy (returned), the
    deadline passes or `stop` is set (None; then `condition` is not called)."""
    deadline = time.monotonic() + timeout
    while stop is None or not stop.is_set():
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)
    return None
