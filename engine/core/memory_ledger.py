"""The memory ledger: who holds the memory budget, in one place.

The resident model's weights; every running request's KV (a request decoded
alone: its grant, allocated once for its prompt and max_tokens; the batch's
rows: their peak, engine/core/scheduler.py); and what is left, the prompt cache's
room, which the cache reads from here and keeps within itself. MLX's
allocator (its active memory and its buffer cache) is limited to the budget
less what the process holds outside MLX, measured from outside
(engine/core/device_memory.py), so everything the process holds is counted.

Owned by the engine core (engine/core/engine_core.py) on the worker thread; its
decisions are scheduler.py's and mlxd.memory_estimate's pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mlxd.memory_estimate import (KVLayout, kv_allocated_tokens, kv_cache_bytes, kv_prefill_transient_bytes,
                                  vision_encoder_bytes)

from .device_memory import mlx_limit
from ..model.errors import EngineError
from .scheduler import Memory, Row, batch_kv_bytes, fits


@dataclass(frozen=True)
class ModelFigures:
    """The resident model as the ledger counts it."""

    weights_bytes: int | None  # None: its size is unknown (nothing to count by)
    config: dict  # its config.json: KV per position
    kv: KVLayout  # how a request decoded alone holds its KV (kv_bits)


class MemoryLedger:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.limit_bytes = budget_bytes  # MLX's active + cached memory stays under this
        self.model: ModelFigures | None = None
        self._alone: dict[str, int] = {}  # request id -> KV bytes granted to a request decoded alone
        self._rows: tuple[Row, ...] = ()  # the batch's rows
        self.memory = Memory(0, None, 0)  # the scheduler's view of the model (_set_memory)

    # --- the resident model ------------------------------------------------
    def set_model(self, model: ModelFigures | None) -> None:
        self.model = model
        self._alone.clear()
        self._rows = ()
        self._set_memory()

    def _set_memory(self) -> None:
        """The resident model's figures for the scheduler's admission (at MLX's
        limit), worked out once: the scheduler reads them every step."""
        m = self.model
        if m is None:
            self.memory = Memory(0, None, 0)
        elif not m.config:  # its KV per position unknown: slots alone limit the batch
            self.memory = Memory(self.limit_bytes, m.weights_bytes, 0)
        else:
            self.memory = Memory(self.limit_bytes, m.weights_bytes, kv_cache_bytes(m.config, 1), m.kv.coarse_steps)

    def lower_limit(self, outside_bytes: int) -> int | None:
        """MLX's limit after measuring `outside_bytes` held outside it: the new
        limit when it changed (the caller tells MLX), else None."""
        limit = mlx_limit(self.budget_bytes, outside_bytes)
        if limit == self.limit_bytes:
            return None
        self.limit_bytes = limit
        self._set_memory()
        return limit

    # --- requests -------------------------------------------------------------
    def request_bytes(self, tokens: int, image_tokens: int = 0) -> int:
        """A request decoded alone: its KV allocated once for `tokens`
        positions in whole steps (engine/cache/kv_cache.py) as the model's layout
        holds it, what its prefill holds beside a quantised cache, and its
        images' encoding."""
        m = self.model
        if m is None or not m.config:
            return 0
        positions = kv_allocated_tokens(tokens, m.kv.coarse_steps)
        return (kv_cache_bytes(m.config, positions, layout=m.kv) + kv_prefill_transient_bytes(m.config, positions, m.kv)
                + vision_encoder_bytes(m.config, image_tokens))

    def check_alone(self, tokens: int, image_tokens: int = 0) -> int:
        """The KV a request needs to be decoded alone; the 400 for a request
        that cannot fit beside the model even with the prompt cache empty (the
        gateway falls back) rather than run into Metal's out-of-memory abort."""
        need = self.request_bytes(tokens, image_tokens)
        m = self.model
        if m is None or m.weights_bytes is None or not m.config:
            return need  # size unknown: nothing to go by
        if m.weights_bytes + need > self.limit_bytes:
            raise EngineError(400, f"this request needs {need / 2**30:.2f} GiB of KV cache (and image encoding) for "
                                   f"{tokens} tokens (prompt + max_tokens), which does not fit beside the model in the "
                                   f"memory budget of {self.limit_bytes / 2**30:.2f} GiB; shorten the prompt or "
                                   "max_tokens", code="context_length_exceeded", param="messages")
        return need

    def grant_alone(self, request_id: str, tokens: int, image_tokens: int = 0) -> None:
        """A request decoded alone holds its KV from now (check_alone's 400 first)."""
        self._alone[request_id] = self.check_alone(tokens, image_tokens)

    def fits_batch(self, rows: Sequence[Row]) -> bool:
        return fits(self.memory, rows)

    def hold_rows(self, rows: Sequence[Row]) -> None:
        """The batch's rows now (with a row about to join, before its KV is taken)."""
        self._rows = tuple(rows)

    def release(self, request_id: str) -> None:
        self._alone.pop(request_id, None)

    def keep_alone(self, request_ids: set[str]) -> None:
        """Grants kept only for these requests (one that joined the batch is one of its rows now)."""
        for request_id in [r for r in self._alone if r not in request_ids]:
            del self._alone[request_id]

    # --- what is left -----------------------------------------------------------
    def cache_room(self) -> int | None:
        """Bytes the prompt cache may keep beside the model and the running
        requests; None when the model's size is unknown (nothing to count by)."""
        m = self.model
        if m is None or m.weights_bytes is None or not m.config:
            return None
        held = sum(self._alone.values()) + (batch_kv_bytes(self.memory, self._rows) if self._rows else 0)
        return max(0, self.limit_bytes - m.weights_bytes - held)
