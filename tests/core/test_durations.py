"""Durations as Ollama writes them (mlxd.durations) and the idle unload's
decisions (engine/core/keep_alive.py), as tables."""

from __future__ import annotations

import math

import pytest

from mlxd.durations import NEVER, describe, parse_duration
from mlxd.engine.core.keep_alive import unload_deadline, unload_due


@pytest.mark.parametrize("value, seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0), ("500ms", 0.5), ("1.5h", 5400.0), ("2m30s", 150.0),
    (300, 300.0), (2.5, 2.5), ("300", 300.0), ("0", 0.0), (0, 0.0),   # a number: seconds, as Ollama reads it
    (-1, NEVER), ("-1", NEVER), ("-5m", NEVER),                         # negative: never unload
])
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 m", "", "5mm", "m", "1d", True, math.nan])
def test_what_is_not_a_duration_is_refused(value):
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize("seconds, shown", [(NEVER, "never"), (0.0, "0 s"), (90.0, "90 s"), (300.0, "5 min"),
                                            (5400.0, "1 h 30 min"), (7200.0, "2 h")])
def test_durations_for_people(seconds, shown):
    assert describe(seconds) == shown


@pytest.mark.parametrize("now, deadline, resident, busy, due", [
    (100.0, 99.0, True, False, True),     # idle past its keep_alive: given back
    (100.0, 101.0, True, False, False),   # not yet
    (100.0, 99.0, True, True, False),     # a request running or waiting: never while busy
    (100.0, 99.0, False, False, False),   # nothing resident
    (100.0, NEVER, True, False, False),   # keep_alive < 0
    (100.0, 100.0, True, False, True),    # keep_alive 0: as soon as the request ended
])
def test_when_the_model_is_given_back(now, deadline, resident, busy, due):
    assert unload_due(now, deadline, resident, busy) is due


def test_each_requests_end_sets_the_deadline():
    assert unload_deadline(50.0, 300.0) == 350.0 and unload_deadline(50.0, 0.0) == 50.0
    assert unload_deadline(50.0, NEVER) == NEVER
