"""What the engine core does next: pure decisions, table-tested.

Each step of the core (engine/core/engine_core.py) asks `next_step` once:

- TAKE    the queue's next request, to prepare it (tokenize, size its KV);
- ADMIT   the prepared request into the running batch: there is a free slot
          and the KV of every running request at its full length, plus its
          own, fits the memory budget beside the model;
- ALONE   decode the prepared request by itself (max_concurrency = 1, an
          image, a seed, another model, a rank group: what may not join the
          batch), once the batch has drained — requests are served in
          order, nothing overtakes it, nothing joins it;
- DECODE  a token for every running request (the one decoded alone, or the
          batch's, after a chunk of a joining request's prompt);
- WAIT    nothing to do: wait for the queue.

Memory is admitted by construction: `rows_kv_tokens` bounds what the
batch's KV can grow to before any of it is allocated (each row's own,
allocated once for its prompt and answer), and the prompt cache gets only
what the running requests leave (`cache_room`) — it yields to them, never the
other way round.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from mlxd.memory_estimate import kv_allocated_tokens

from ..model.decoder_rows import Admitted


class Step(enum.Enum):
    TAKE = "take"
    ADMIT = "admit"
    ALONE = "alone"
    DECODE = "decode"
    WAIT = "wait"


@dataclass(frozen=True)
class Row:
    """A request in the batch, as memory sees it."""

    length: int  # positions its KV holds (or will, once its prompt is in): prompt + generated so far
    remaining: int  # tokens it may still generate
    alone: bool = False  # decoded alone: nobody joins it (a seed, an image, a rank group, max_concurrency 1)


def row_of(admitted: Admitted) -> Row:
    """A request in a decoder, as memory sees it."""
    generated = len(admitted.generation.tokens)
    return Row(len(admitted.prompt) + generated, admitted.job.params.max_tokens - generated, admitted.alone)


@dataclass(frozen=True)
class Memory:
    budget_bytes: int
    weights_bytes: int | None  # None: the model's size is unknown, so slots alone limit the batch
    kv_bytes_per_token: int  # every layer's K and V for one position; 0 when unknown
    coarse_steps: bool = False  # rows' KV in coarse steps (KVLayout.coarse_steps: MLX's CUDA backend)


@dataclass(frozen=True)
class Pending:
    """The request taken from the queue, prepared."""

    batchable: bool
    row: Row | None = None  # None when it is served alone


def rows_kv_tokens(rows: Sequence[Row], coarse_steps: bool = False) -> int:
    """KV positions of the batch's rows at their peak: each row its own
    length plus what it may still generate, allocated as the row's cache is
    (kv_allocated_tokens: nothing padded, nothing copied when rows join or
    leave: engine/model/row_batch.py)."""
    return sum(kv_allocated_tokens(r.length + r.remaining, coarse_steps) for r in rows)


def batch_kv_bytes(memory: Memory, rows: Sequence[Row]) -> int:
    """The batch's KV at its peak (a row's prefill attends fused, over its own cache: nothing beside it)."""
    return rows_kv_tokens(rows, memory.coarse_steps) * memory.kv_bytes_per_token


def fits(memory: Memory, rows: Sequence[Row]) -> bool:
    """Whether these rows' KV at full length fits beside the model."""
    if memory.weights_bytes is None or memory.kv_bytes_per_token <= 0:
        return True  # size unknown: nothing to go by (as for a single request)
    return memory.weights_bytes + batch_kv_bytes(memory, rows) <= memory.budget_bytes


def cache_room(memory: Memory, rows: Sequence[Row], cache_bytes: int) -> int:
    """Bytes the prompt cache may keep beside the model and these rows."""
    if memory.weights_bytes is None or memory.kv_bytes_per_token <= 0:
        return cache_bytes
    return max(0, min(cache_bytes, memory.budget_bytes - memory.weights_bytes - batch_kv_bytes(memory, rows)))


def next_step(pending: Pending | None, waiting: bool, rows: Sequence[Row], slots: int, memory: Memory) -> Step:
    """The worker's next step (pure; the first that holds wins)."""
    if any(r.alone for r in rows):
        return Step.DECODE  # a request decoded alone: nobody joins it, nobody is taken meanwhile
    if pending is not None:
        if not pending.batchable or pending.row is None or slots <= 1:
            return Step.DECODE if rows else Step.ALONE
        if not rows:
            return Step.ADMIT  # alone it fits: that was checked when it was prepared
        if len(rows) < slots and fits(memory, [*rows, pending.row]):
            return Step.ADMIT
        return Step.DECODE  # it waits, first in line, until running requests end
    if waiting and len(rows) < slots:
        return Step.TAKE
    return Step.DECODE if rows else Step.WAIT
