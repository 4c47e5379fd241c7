"""The worker's turns when it serves one request alone: every request with
`max_concurrency` = 1, and what the batch cannot take (an image, a seed,
another model, a rank group). Through mlx-lm's `stream_generate` (mlx-vlm's
for a vision model; mirrored across a rank group).

A part of ModelWorker (mixed in, as batched_turns.py is); the state it touches
is the worker's, owned by the worker thread.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from .errors import EngineError
from .events import Failed, Started
from .generation import Generation, VisionPrompt, prefill, tokenize, vision_prompt
from .jobs import Job
from .request_table import RequestStatus
from .worker_state import Phase

if TYPE_CHECKING:
    from .worker import ModelWorker

log = logging.getLogger("mlxd.engine.worker")


class LoneTurns:
    """ModelWorker's lone path (see the module's docstring)."""

    def _serve(self: "ModelWorker", job: Job) -> None:
        started = time.monotonic()
        self._timeline = [("taken", started)]
        self.counters["jobs"] += 1
        self.table.hold(job, RequestStatus.PREFILLING)
        self._record_inflight()
        try:
            if job.cancelled.is_set():
                return
            self.faults.refresh()
            self.faults.check("start", request_text=job.text)
            self._ensure_model(job.model_id)
            self._publish(Phase.PREFILL)
            if self._resident.vision:
                vision = vision_prompt(self._resident, job, self.max_prompt_tokens)
                tokens = vision.tokens
            else:
                vision, tokens = None, tokenize(self._resident, job, self.max_prompt_tokens)
            self._heartbeat()  # tokenizing a long prompt is progress, not a hang
            self._mark("tokenized")
            job.channel.put(Started(len(tokens)))
            self._generate(job, tokens, vision)
        except EngineError as exc:
            job.channel.put(Failed(exc))
        except BaseException as exc:  # noqa: BLE001 - an MLX fault: do not limp on
            self._fatal(exc, [job])
        finally:
            if self.status.phase is not Phase.FAILED:
                self.table.release(job)
                self._publish(Phase.IDLE)
                self._record_inflight()
            self._mark("done")
            if log.isEnabledFor(logging.DEBUG):  # where a request's time went, for the queue's dead time
                log.debug("request %s: %s", job.id, " ".join(f"{k} {1000 * (t - started):.1f} ms"
                                                             for k, t in self._timeline[1:]))
            self.admission.done(job, time.monotonic() - started)

    def _mark(self: "ModelWorker", moment: str) -> None:
        self._timeline.append((moment, time.monotonic()))

    def _generate(self: "ModelWorker", job: Job, prompt: list[int], vision: VisionPrompt | None = None) -> None:
        started = time.monotonic()
        first_token_at: list[float] = []

        def on_decode() -> None:
            first_token_at.append(time.monotonic())
            self._mark("first_token")
            self.table.hold(job, RequestStatus.DECODING)
            self._publish(Phase.DECODE)

        generation = Generation(self._resident, job, self.faults, self.pace, self._heartbeat,
                                on_decode=on_decode)
        if self.link is not None:
            self._generate_mirrored(job, prompt, generation)
            return
        if vision is not None:
            self._room_beside(job, prompt, vision.image_tokens)  # raises the 400 for a request that cannot fit
            self._run_generation(generation, len(prompt), 0, lambda: generation.decode_vision(vision))
            self._sample_memory()
            return
        room = self._room_beside(job, prompt)  # raises the 400 for a request that cannot fit
        fetched, kv, needs_snapshot = self._cached_start(job, prompt, room, allocate=True)
        self._mark("cache_fetched")
        rest, snapshot = prompt[fetched.start:], None
        if needs_snapshot:
            from .kv_cache import fitted

            # Kept at the prompt's boundary: this cache cannot be cut back later.
            prefill(self._resident.model, kv, rest[:-1], self.pace, self._heartbeat, self.faults, self._resident.kv,
                    cancelled=job.cancelled)
            snapshot, rest = fitted(kv, copy_others=True), rest[-1:]
        generated = self._run_generation(generation, len(prompt), fetched.cached_tokens,
                                         lambda: generation.decode(rest, kv, prompt[:len(prompt) - len(rest)]))
        self._mark("decoded")
        self._store_turn(job, prompt, fetched, generated, kv, snapshot, needs_snapshot,
                         first_token_at[0] - started if first_token_at else None, alone=True)
        self._mark("stored")
        self._sample_memory()

    def _generate_mirrored(self: "ModelWorker", job: Job, prompt: list[int], generation: Generation) -> None:
        """A rank group's generation: no prompt cache; the other ranks keep a
        KV cache of their own shard from BEGIN to END."""
        from .ranks import BEGIN, END

        self._room_beside(job, prompt)  # raises the 400 for a request that cannot fit
        self.link.share((BEGIN,))
        try:
            self._run_generation(generation, len(prompt), 0, lambda: generation.decode(prompt))
        finally:
            self.link.share((END,))
        self._sample_memory()

    def _run_generation(self: "ModelWorker", generation: Generation, prompt_tokens: int, cached: int,
                        decode: Callable[[], tuple[str, list[int]]]) -> list[int]:
        """Decode, count, and send the answer's end; the tokens generated."""
        finish, generated = decode()
        # Counted before the last event: a client that reads /metrics right
        # after its answer sees its tokens.
        self.counters["generated_tokens"] += len(generated)
        self.counters["prompt_tokens"] += prompt_tokens
        generation.end(finish, prompt_tokens, len(generated), cached)
        return generated
