"""The one-model cache policy: at most one model resident, ever.

`plan_switch` is the pure decision; the worker carries the steps out in order
(an unload always completes, memory released, before the next load starts).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unload:
    model_id: str


@dataclass(frozen=True)
class Load:
    model_id: str


def plan_switch(resident: str | None, wanted: str) -> list[Unload | Load]:
    """Steps to make `wanted` the resident model (pure)."""
    if resident == wanted:
        return []
    steps: list[Unload | Load] = [] if resident is None else [Unload(resident)]
    return steps + [Load(wanted)]


def plan_release(resident: str | None) -> list[Unload]:
    """Steps to drop the resident model (e.g. after a failed load)."""
    return [] if resident is None else [Unload(resident)]
