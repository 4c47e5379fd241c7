"""The batched worker's decisions (engine/scheduler.py), as tables."""

from __future__ import annotations

import pytest

from mlxd.engine.scheduler import Memory, Pending, Row, Step, batch_kv_tokens, cache_room, fits, next_step

MB = 2**20
# A model of 100 MiB whose KV takes 1 KiB a position, in a 110 MiB budget: 10 MiB = 10,240 positions of KV.
MEM = Memory(budget_bytes=110 * MB, weights_bytes=100 * MB, kv_bytes_per_token=1024)
UNKNOWN = Memory(budget_bytes=110 * MB, weights_bytes=None, kv_bytes_per_token=0)


@pytest.mark.parametrize("rows, positions", [
    ([], 0),
    ([Row(100, 100)], 256),                          # one step: nothing to grow from
    ([Row(300, 100)], 512 + 256),                    # grows from 256 to 512: both alive for a moment
    ([Row(100, 100), Row(10, 20)], 2 * 256),         # the short row is padded to the long one
    ([Row(1000, 24), Row(10, 500)], 2 * (1536 + 1280)),  # the longest row plus the most any may still generate
])
def test_batch_kv_tokens(rows, positions):
    assert batch_kv_tokens(rows) == positions


@pytest.mark.parametrize("rows, fit", [
    ([Row(100, 100)] * 40, True),                    # 40 x 256 = 10,240 positions: exactly the room
    ([Row(100, 100)] * 41, False),
    ([Row(3000, 1000)] * 2, False),                  # 2 x (4096 + 3840)
    ([Row(3000, 1000)], True),
])
def test_fits(rows, fit):
    assert fits(MEM, rows) is fit
    assert fits(UNKNOWN, rows) is True  # a model of unknown size: slots alone limit the batch


# The same model, with a prefill step's attention costing 1 KiB a position of each row's context too.
ATTN = Memory(budget_bytes=110 * MB, weights_bytes=100 * MB, kv_bytes_per_token=1024, attention_bytes_per_position=1024)


@pytest.mark.parametrize("rows, fit", [
    ([Row(100, 100)] * 20, True),    # 20 x (256 KV + 256 attention) KiB = 10,240 KiB: exactly the room
    ([Row(100, 100)] * 21, False),
    ([Row(2000, 100)], True),        # KV 2,304 + 2,048 grown from; attention over 2,304: 6,656 KiB
    ([Row(3000, 1000)], False),      # KV 4,096 + 3,840; attention over 4,096: 12,032 KiB
])
def test_fits_counts_the_attention_of_a_prefill_step(rows, fit):
    assert fits(ATTN, rows) is fit


@pytest.mark.parametrize("rows, cache_bytes, room", [
    ([], 50 * MB, 10 * MB),                          # the cache gives way to running requests
    ([Row(100, 100)] * 20, 50 * MB, 5 * MB),
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
