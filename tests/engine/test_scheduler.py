"""The batched worker's decisions (engine/core/scheduler.py), as tables."""

from __future__ import annotations

import pytest

from mlxd.engine.core.scheduler import (Memory, Pending, Row, Step, batch_kv_bytes, batch_kv_tokens, cache_room, fits,
                                        next_step, rows_kv_tokens)
from mlxd.engine.model.decoding import starts_alone

MB = 2**20
# A model of 100 MiB whose KV takes 1 KiB a position, in a 110 MiB budget: 10 MiB = 10,240 positions of KV.
MEM = Memory(budget_bytes=110 * MB, weights_bytes=100 * MB, kv_bytes_per_token=1024)
UNKNOWN = Memory(budget_bytes=110 * MB, weights_bytes=None, kv_bytes_per_token=0)


@pytest.mark.parametrize("rows, positions", [
    ([], 0),
    ([Row(100, 100)], 256),                          # alone: allocated once, in whole steps
    ([Row(300, 100)], 512),
    ([Row(100, 100), Row(10, 20)], 2 * 2 * 256),     # the short row is padded to the long one; a join copies
    ([Row(1000, 24), Row(10, 500)], 2 * 2 * 1536),   # the longest row plus the most any may still generate
])
def test_batch_kv_tokens(rows, positions):
    assert batch_kv_tokens(rows) == positions


@pytest.mark.parametrize("rows, positions", [
    ([], 0),
    ([Row(100, 100)], 256),
    ([Row(100, 100), Row(10, 20)], 256 + 256),       # each row its own: nothing padded, nothing copied
    ([Row(1000, 24), Row(10, 500)], 1024 + 512),
    ([Row(20000, 128)] + [Row(300, 128)] * 3, 20224 + 3 * 512),  # a long agent beside short ones
])
def test_rows_kv_tokens(rows, positions):
    assert rows_kv_tokens(rows) == positions


def test_rows_apart_count_their_own_kv_and_no_padded_attention():
    apart = Memory(budget_bytes=110 * MB, weights_bytes=100 * MB, kv_bytes_per_token=1024,
                   attention_bytes_per_position=1024, rows_apart=True)
    rows = [Row(1000, 24), Row(10, 500)]
    assert batch_kv_bytes(apart, rows) == (1024 + 512) * 1024
    assert fits(apart, [Row(100, 100)] * 40) and not fits(apart, [Row(100, 100)] * 41)  # 40 x 256 = 10,240


@pytest.mark.parametrize("rows, fit", [
    ([Row(100, 100)] * 20, True),                    # 20 x 256, twice at a join: 10,240 positions, exactly the room
    ([Row(100, 100)] * 21, False),
    ([Row(3000, 1000)] * 2, False),                  # 2 x 4096, twice
    ([Row(3000, 1000)], True),                       # alone: 4096
])
def test_fits(rows, fit):
    assert fits(MEM, rows) is fit
    assert fits(UNKNOWN, rows) is True  # a model of unknown size: slots alone limit the batch


# The same model, with a prefill step's attention costing 1 KiB a position of each row's context too.
ATTN = Memory(budget_bytes=110 * MB, weights_bytes=100 * MB, kv_bytes_per_token=1024, attention_bytes_per_position=1024)


@pytest.mark.parametrize("rows, fit", [
    ([Row(100, 100)] * 13, True),    # 13 x (2 x 256 KV + 256 attention) KiB = 9,984 KiB
    ([Row(100, 100)] * 14, False),   # 10,752 KiB
    ([Row(2000, 100)], True),        # KV 2,304; attention over 2,304: 4,608 KiB
    ([Row(3000, 1000)], True),       # KV 4,096; attention over 4,096: 8,192 KiB
    ([Row(3000, 1000), Row(100, 100)], False),  # 2 x 2 x 4,096 KV: over
])
def test_fits_counts_the_attention_of_a_prefill_step(rows, fit):
    assert fits(ATTN, rows) is fit


@pytest.mark.parametrize("rows, cache_bytes, room", [
    ([], 50 * MB, 10 * MB),                          # the cache gives way to running requests
    ([Row(100, 100)] * 10, 50 * MB, 5 * MB),         # 10 x 256 positions, twice at a join
    ([Row(100, 100)] * 10, 1 * MB, 1 * MB),          # never more than it holds
    ([Row(100, 100)] * 25, 8 * MB, 0),               # over the budget (a tolerated overshoot): nothing left
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


@pytest.mark.parametrize("batch_empty, others_waiting, alone", [
    (True, False, True),     # one agent at a time: decoded as mlx-lm decodes one (a batch of one is slower)
    (True, True, False),     # a burst: the first prefilled with the others, not ahead of them
    (False, False, False),   # a batch runs: it joins it
    (False, True, False),
])
def test_a_request_starts_alone_only_into_an_empty_batch_with_nobody_waiting(batch_empty, others_waiting, alone):
    assert starts_alone(batch_empty, others_waiting) == alone
