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
    deadline passes or `stop` is set (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline or (stop is not None and stop.is_set()):
            return None
        time.sleep(interval)
