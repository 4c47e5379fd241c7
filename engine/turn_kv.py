"""A turn's KV, the steps both ways of serving share (lone_turns.py,
batched_turns.py): the room its request leaves the prompt cache beside the
model (or the 400 for a request that cannot fit), the KV taken from the
prompt cache (engine/reuse.py plans it) and, after the answer, stored back.

A part of ModelWorker (mixed in, as lone_turns.py is); the state it touches
is the worker's, owned by the worker thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from mlxd.memory_estimate import (KVLayout, kv_allocated_tokens, kv_cache_bytes, kv_prefill_transient_bytes,
                                  request_fits, vision_encoder_bytes)

from .errors import EngineError
from .jobs import Job
from .prefill import recompute
from .prompt_cache import Fetched, kv_offset
from .prompt_cache_policy import needs_boundary_snapshot
from .prompt_tokens import answer_echo

if TYPE_CHECKING:
    from .worker import ModelWorker

log = logging.getLogger("mlxd.engine.worker")


class TurnKV:
    """ModelWorker's prompt-cache steps of a turn (see the module's docstring)."""

    def _room_beside(self: "ModelWorker", job: Job, prompt: list[int], image_tokens: int = 0) -> int:
        """Bytes the prompt cache may keep while this request runs: its own KV
        must fit beside the model, so the cache gives way first, and a request
        that cannot fit even then is refused with a 400 (the gateway falls
        back) rather than run into Metal's out-of-memory abort."""
        info = self.registry.info(job.model_id)
        if info.footprint.weights_bytes is None or not info.config:
            return self.prompt_cache.stats.memory_bytes  # size unknown: nothing to go by
        tokens = len(prompt) + job.params.max_tokens
        need = self._request_bytes(info.config, tokens) + vision_encoder_bytes(info.config, image_tokens)
        fits, room = request_fits(self.registry.budget_bytes, info.footprint.weights_bytes, need,
                                  self.prompt_cache.stats.memory_bytes)
        if not fits:
            raise EngineError(400, f"this request needs {need / 2**30:.2f} GiB of KV cache (and image encoding) for "
                                   f"{tokens} tokens "
                                   f"(prompt + max_tokens), which does not fit beside the model in the memory budget "
                                   f"of {self.registry.budget_bytes / 2**30:.2f} GiB; shorten the prompt or max_tokens",
                              code="context_length_exceeded", param="messages")
        return room

    def _request_bytes(self: "ModelWorker", config: dict, tokens: int) -> int:
        """A lone request's KV, allocated once for `tokens` positions in whole
        steps (engine/kv_cache.py), as the resident model's layout holds it,
        and what its prefill holds beside a quantised cache."""
        kv = self._resident.kv if self._resident is not None else KVLayout()
        positions = kv_allocated_tokens(tokens)
        return kv_cache_bytes(config, positions, layout=kv) + kv_prefill_transient_bytes(config, positions, kv)

    def _cached_start(self: "ModelWorker", job: Job, prompt: list[int], room: int,
                      allocate: bool = False) -> tuple[Fetched, list[Any] | None, bool]:
        """The turn's KV from the prompt cache (engine/reuse.py plans it):
        taken, its changed spans recomputed, the rest of the cache shrunk to
        `room`; and whether the KV must be kept at the prompt's boundary (a
        cache that cannot be cut back later). `allocate`: the KV gets its
        whole length (prompt + max_tokens) now, once (a lone request; a
        batch keeps its own arrays)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        from .kv_cache import make_kv

        cache = self.prompt_cache
        answer_room = job.params.max_tokens if allocate else 0
        config = self.registry.info(job.model_id).config
        # The request's KV for its prompt was admitted (_room_beside): a disk entry that size may be read into it.
        read_room = self._request_bytes(config, len(prompt)) if config else 0
        fetched = cache.fetch(prompt, answer_room, read_room, keep_bytes=room)
        self._log_reuse(job, fetched)
        if room < cache.stats.memory_bytes:
            cache.shrink_to(room)
        kv, needs_snapshot = fetched.kv, False
        if fetched.patches:
            recompute(self._resident.model, kv, prompt, fetched.patches, fetched.start, self.pace, self._heartbeat,
                      cancelled=job.cancelled)
        if kv is None and allocate:
            kv = make_kv(self._resident.model, len(prompt) + answer_room, self._resident.kv)
        if cache.enabled:
            # Allocated once for its prompt: a batch's row is prefilled alone, and a cache grown by
            # concatenation holds its old and new arrays at once at every step (engine/kv_cache.py).
            kv = kv if kv is not None else make_kv(self._resident.model, len(prompt), KVLayout())
            needs_snapshot = needs_boundary_snapshot([type(c).__name__ for c in kv], can_trim_prompt_cache(kv))
        return fetched, kv, needs_snapshot

    def _store_turn(self: "ModelWorker", job: Job, prompt: list[int], fetched: Fetched, generated: list[int],
                    kv: list[Any] | None, snapshot: list[Any] | None, needs_snapshot: bool, prefill_s: float | None,
                    alone: bool = False) -> None:
        """The turn's KV back to the prompt cache: at the prompt's boundary
        (`snapshot`) where it cannot be cut back, else all it covers, copied
        into arrays of just that length (a lone request's were allocated for
        all of max_tokens). The copy is made while the request's own arrays
        are alive, so for a lone request the cache first gives up what the
        copy needs: memory stays within the budget (a batch's rows are
        counted by the batch's admission)."""
        from .kv_cache import fitted, fitted_bytes
        from .kv_files import kv_nbytes

        cache = self.prompt_cache
        if not cache.enabled:
            return
        if kv is not None and not needs_snapshot:
            weights = self.registry.info(job.model_id).footprint.weights_bytes
            if alone and weights is not None:
                allowed = self.registry.budget_bytes - weights - kv_nbytes(kv) - fitted_bytes(kv)
                if cache.stats.memory_bytes > allowed:
                    cache.shrink_to(max(0, allowed))
            kv = fitted(kv)
        if prefill_s is not None:
            recomputed = sum(end - start for start, end in fetched.patches)
            cache.note_prefill(len(prompt) - fetched.start + recomputed, prefill_s)
        echo = answer_echo(self._resident.tokenizer, generated)
        if needs_snapshot:
            if snapshot is not None:
                cache.store(prompt[:-1], len(prompt) - 1, snapshot, job.conversation, fetched, echo)
        elif kv is not None:
            cache.store((prompt + generated)[:kv_offset(kv) or 0], len(prompt), kv, job.conversation, fetched, echo)

    def _log_reuse(self: "ModelWorker", job: Job, fetched: Fetched) -> None:
        """At debug level, what the prompt and the cached conversation hold
        where reuse stopped: which agent field broke the cache."""
        if fetched.excerpt is None or not log.isEnabledFor(logging.DEBUG):
            return
        decode = self._resident.tokenizer.decode
        cached, sent = fetched.excerpt
        log.debug("prompt cache: request %s (conversation %s) reused %d tokens; where it stopped the cache holds "
                  "%r and the prompt has %r", job.id, fetched.name, fetched.cached_tokens, decode(cached), decode(sent))
