"""The batched worker's decisions (engine/core/scheduler.py), as tables."""

from __future__ import annotations

import pytest

from mlxd.engine.core.scheduler import (Memory, Pending, Row, Step, batch_kv_bytes, cache_room, fits, next_step,
                                        rows_kv_tokens)

MB = 2**20
# A model of 100 MiB whose KV takes 1 KiB a position, in a 110 MiB budget: 10 MiB = 10,240 positions of KV.
MEM = Memory(budget_bytes=110 * MB, weights_bytes=100 * MB, kv_bytes_per_token=1024)
UNKNOWN = Memory(budget_bytes=110 * MB, weights_bytes=None, kv_bytes_per_token=0)


@pytest.mark.parametrize("rows, positions", [
    ([], 0),
    ([Row(100, 100)], 256),
    ([Row(100, 100), Row(10, 20)], 256 + 256),       # each row its own: nothing padded, nothing copied
    ([Row(1000, 24), Row(10, 500)], 1024 + 512),
    ([Row(20000, 128)] + [Row(300, 128)] * 3, 20224 + 3 * 512),  # a long agent beside short ones
])
def test_rows_kv_tokens(rows, positions):
    assert rows_kv_tokens(rows) == positions


@pytest.mark.parametrize("rows, positions", [
    ([Row(100, 100)], 256),                          # short rows: whole steps as ever
    ([Row(1000, 24), Row(10, 500)], 1024 + 512),
    ([Row(20000, 128)] + [Row(300, 128)] * 3, 20480 + 3 * 512),  # 20,128 in steps of 2,048
    ([Row(15000, 128), Row(15200, 128)], 2 * 15360),  # two agents' lengths: one buffer length, one cuDNN graph
])
def test_rows_kv_tokens_in_coarse_steps_as_their_caches_are_allocated(rows, positions):
    assert rows_kv_tokens(rows, coarse_steps=True) == positions
    coarse = Memory(budget_bytes=10**12, weights_bytes=0, kv_bytes_per_token=2, coarse_steps=True)
    assert batch_kv_bytes(coarse, rows) == 2 * positions


def test_rows_count_their_own_kv():
    rows = [Row(1000, 24), Row(10, 500)]
    assert batch_kv_bytes(MEM, rows) == (1024 + 512) * 1024
    assert fits(MEM, [Row(100, 100)] * 40) and not fits(MEM, [Row(100, 100)] * 41)  # 40 x 256 = 10,240


@pytest.mark.parametrize("rows, fit", [
    ([Row(100, 100)] * 40, True),                    # 40 x 256: 10,240 positions, exactly the room
    ([Row(100, 100)] * 41, False),
    ([Row(3000, 1000)] * 2, True),                   # 2 x 4096
    ([Row(3000, 1000)] * 3, False),
    ([Row(9000, 1000)], True),                       # alone: 10,240
])
def test_fits(rows, fit):
    assert fits(MEM, rows) is fit
    assert fits(UNKNOWN, rows) is True  # a model of unknown size: slots alone limit the batch


@pytest.mark.parametrize("rows, cache_bytes, room", [
    ([], 50 * MB, 10 * MB),                          # the cache gives way to running requests
    ([Row(100, 100)] * 20, 50 * MB, 5 * MB),         # 20 x 256 positions
    ([Row(100, 100)] * 20, 1 * MB, 1 * MB),          # never more than it holds
    ([Row(100, 100)] * 50, 8 * MB, 0),               # over the budget (a tolerated overshoot): nothing left
])
def test_cache_room(rows, cache_bytes, room):
    assert cache_room(MEM, rows, cache_bytes) == room
    assert cache_room(UNKNOWN, rows, cache_bytes) == cache_bytes


SMALL = Row(100, 100)
HUGE = Row(9000, 1000)  # fits alone (10,240 positions), never beside another


@pytest.mark.parametrize("pending, waiting, rows, slots, step", [
    (None, False, [], 4, Step.WAIT),                           # nothing to do
    (None, True, [], 4, Step.TAKE),                            # a request waits: prepare it
    (None, True, [SMALL] * 3, 4, Step.TAKE),
    (None, True, [SMALL] * 4, 4, Step.DECODE),                 # every slot held: the queue waits
    (None, False, [SMALL], 4, Step.DECODE),
    (Pending(True, SMALL), False, [], 4, Step.ADMIT),
    (Pending(True, SMALL), True, [SMALL] * 2, 4, Step.ADMIT),  # admit before decoding: a short wait for it
    (Pending(True, HUGE), False, [SMALL], 4, Step.DECODE),     # memory: it waits, first in line
    (Pending(True, HUGE), False, [], 4, Step.ADMIT),           # alone it fits (checked when prepared)
    (Pending(True, SMALL), False, [SMALL] * 4, 4, Step.DECODE),  # no slot
    (Pending(False), False, [SMALL], 4, Step.DECODE),          # served alone once the batch drains...
    (Pending(False), True, [], 4, Step.ALONE),                 # ... then before anything behind it
    (Pending(True, SMALL), False, [], 1, Step.ALONE),          # single concurrency: every request alone
])
def test_next_step(pending, waiting, rows, slots, step):
    assert next_step(pending, waiting, rows, slots, MEM) is step
