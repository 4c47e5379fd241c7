"""mlx-lm's batch's KV as mlxd allocated it before its own batch
(engine/model/row_batch.py) replaced mlx-lm's BatchGenerator: kept for the
benchmarks that compare the two (kv_memory.py, batch_join_probe.py,
long_prefill_probe.py). Allocated when rows join, at the length they were
admitted to, not grown in steps while they decode.

mlx-lm's BatchKVCache keeps every row of the batch in one array, as long as
the longest row (shorter ones padded on the left), and grows it by 256
positions at a time by concatenating a longer copy: the batch copies all of
its KV every 256 tokens, and memory climbs a staircase (docs/BENCHMARKS.md,
"Why the engine is built as it is"). Here each row joins with what admission
granted it (the rest of its prompt and max_tokens), and the batch's array is
allocated, once per join, at the longest row plus the most any row has still
to prefill plus the most any row may generate (what admission then
counted). While the batch decodes, nothing is allocated.

Two small subclasses, not a fork: `RowKVCache` is a request's KVCache on its
way into the batch (mlx-lm merges caches by the class of the first row's),
`AllocatedBatchKVCache` is mlx-lm's BatchKVCache with its allocating methods
(`merge`, `extend`, `update_and_fetch`) sizing the array as above and
`filter` keeping its bookkeeping; masks, extraction and trimming are
mlx-lm's. Where the bookkeeping comes short (a row prefilled in several
segments), the array grows as mlx-lm's does: never wrong, only not flat.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from mlxd.memory_estimate import kv_allocated_tokens


class RowKVCache(KVCache):
    """A request's KV as it joins the batch: its arrays (shared, not copied)
    and what admission granted it from here on."""

    def __init__(self, source: KVCache, prompt_left: int, answer_left: int) -> None:
        super().__init__()
        self.keys, self.values, self.offset = source.keys, source.values, source.offset
        self.prompt_left = prompt_left  # prompt tokens still to go through the model
        self.answer_left = answer_left  # tokens it may generate

    @classmethod
    def merge(cls, caches: list[Any]) -> "AllocatedBatchKVCache":
        return AllocatedBatchKVCache.merge(caches)


def rows_for_batch(kv: list[Any], prompt_left: int, answer_left: int) -> list[Any]:
    """A request's cache with each plain KV layer as a RowKVCache (other
    kinds as they are: mlx-lm batches them its own way)."""
    from mlxd.engine.cache.kv_cache import AllocatedKVCache

    return [RowKVCache(c, prompt_left, answer_left) if type(c) in (KVCache, AllocatedKVCache, RowKVCache) else c
            for c in kv]


def spend(prompt_left: list[int], answer_left: list[int], n: int) -> tuple[list[int], list[int]]:
    """Each row's grant after `n` positions went into the batch (pure): a
    row still in its prompt spends prompt tokens (a shorter chunk's padding
    moves the row, not its end), a decoding row spends its answer."""
    prompts, answers = [], []
    for p, a in zip(prompt_left, answer_left):
        if p > 0:
            prompts.append(max(0, p - n))
            answers.append(a)
        else:
            prompts.append(0)
            answers.append(max(0, a - n))
    return prompts, answers


def batch_capacity(idx: int, prompt_left: list[int], answer_left: list[int]) -> int:
    """Positions the batch's array needs (pure): where its rows stand (they
    end together, at `idx`), the most any still has to prefill and the most
    any may generate, in mlx-lm's whole steps."""
    return kv_allocated_tokens(idx + max(prompt_left, default=0) + max(answer_left, default=0))


class AllocatedBatchKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache, allocated at the length its rows were admitted to."""

    def __init__(self, left_padding: list[int], prompt_left: list[int], answer_left: list[int]) -> None:
        super().__init__(left_padding)
        self.prompt_left = list(prompt_left)
        self.answer_left = list(answer_left)

    def __deepcopy__(self, memo: dict) -> "AllocatedBatchKVCache":
        """A copy sharing the arrays: MLX arrays are values (an update makes a
        new one), and mlx-lm's split deep-copies the batch only to filter
        both halves, each into arrays of its own."""
        import copy

        out = copy.copy(self)
        out.prompt_left, out.answer_left = list(self.prompt_left), list(self.answer_left)
        return out

    @classmethod
    def merge(cls, caches: list[Any]) -> "AllocatedBatchKVCache":
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        cache = cls(padding, [getattr(c, "prompt_left", 0) for c in caches],
                    [getattr(c, "answer_left", 0) for c in caches])
        held = [c for c in caches if c.keys is not None]
        if longest == 0 or not held:
            return cache
        first = held[0]
        length = batch_capacity(longest, cache.prompt_left, cache.answer_left)
        keys = mx.zeros((len(caches), first.keys.shape[1], length, first.keys.shape[3]), first.keys.dtype)
        values = mx.zeros((len(caches), first.values.shape[1], length, first.values.shape[3]), first.values.dtype)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is not None:
                keys[i:i + 1, :, p:p + c.offset] = c.keys[..., :c.offset, :]
                values[i:i + 1, :, p:p + c.offset] = c.values[..., :c.offset, :]
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self._idx, keys.shape[2]
        self.prompt_left, self.answer_left = spend(self.prompt_left, self.answer_left, n)
        if self.keys is None or prev + n > self.keys.shape[2]:
            length = batch_capacity(prev + n, self.prompt_left, self.answer_left)
            B, heads, _, k_dim = keys.shape
            new_keys = mx.zeros((B, heads, length, k_dim), keys.dtype)
            new_values = mx.zeros((B, heads, length, values.shape[3]), values.dtype)
            if self.keys is not None:
                new_keys[..., :prev, :] = self.keys[..., :prev, :]
                new_values[..., :prev, :] = self.values[..., :prev, :]
            self.keys, self.values = new_keys, new_values
        self.offset = self.offset + n
        self._idx += n
        self.keys[..., prev:self._idx, :] = keys
        self.values[..., prev:self._idx, :] = values
        return self.keys_and_values()

    def finalize(self) -> None:
        """mlx-lm's, rolling only the positions written (its own rolls the
        whole array: over a long grant, most of a prefill step's time)."""
        if self._right_padding is not None:
            padding = self._right_padding
            for name in ("keys", "values"):
                array = getattr(self, name)
                array[..., :self._idx, :] = dynamic_roll(array[..., :self._idx, :], padding[:, None], axis=2)
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices: Any) -> None:
        """The rows kept, in an array sized for their grants: only the
        positions written are copied (mlx-lm's gathers the whole array)."""
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.prompt_left = [self.prompt_left[i] for i in indices]
        self.answer_left = [self.answer_left[i] for i in indices]
        self.offset = self.offset[mx.array(indices)]
        self.left_padding = self.left_padding[mx.array(indices)]
        shift = min(self.left_padding.tolist())  # padding every kept row has: dropped
        self.left_padding -= shift
        if self.keys is not None:
            kept = mx.array(indices)
            used = self._idx - shift
            length = batch_capacity(used, self.prompt_left, self.answer_left)
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = mx.zeros((len(indices), old.shape[1], length, old.shape[3]), old.dtype)
                new[..., :used, :] = old[kept, :, shift:self._idx, :]
                setattr(self, name, new)
        self._idx -= shift

    def extend(self, other: Any) -> None:
        """The rows of `other` join: one array for all, sized for every row's grant."""
        rows = int(other.offset.shape[0])
        prompt_left = self.prompt_left + list(getattr(other, "prompt_left", [0] * rows))
        answer_left = self.answer_left + list(getattr(other, "answer_left", [0] * rows))
        held = [c for c in (self, other) if c.keys is not None]
        if not held:
            super().extend(other)
        else:
            idx = max(self._idx, other._idx)
            length = batch_capacity(idx, prompt_left, answer_left)
            first = held[0]
            total = int(self.offset.shape[0]) + rows
            keys = mx.zeros((total, first.keys.shape[1], length, first.keys.shape[3]), first.keys.dtype)
            values = mx.zeros((total, first.values.shape[1], length, first.values.shape[3]), first.values.dtype)
            start, paddings = 0, []
            for c in (self, other):
                count = int(c.offset.shape[0])
                shift = idx - c._idx  # rows end together, at idx
                if c.keys is not None:
                    keys[start:start + count, :, shift:idx, :] = c.keys[..., :c._idx, :]
                    values[start:start + count, :, shift:idx, :] = c.values[..., :c._idx, :]
                paddings.append(c.left_padding + shift)
                start += count
            self.offset = mx.concatenate([self.offset, other.offset])
            self.left_padding = mx.concatenate(paddings)
            self.keys, self.values, self._idx = keys, values, idx
        self.prompt_left, self.answer_left = prompt_left, answer_left
