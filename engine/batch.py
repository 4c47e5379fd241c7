"""Batched generation (`max_concurrency` > 1): the running requests decoded
as one batch by mlx-lm's BatchGenerator, on the worker thread.

`BatchRun` owns the BatchGenerator and one `Admitted` per request in it. Each
request keeps all it has alone: its sampler and penalties, its Generation
(stop strings, reasoning and tool-call parsing, deadline, cancellation), its
detokenizer. The worker decides who joins (engine/scheduler.py) and owns the
prompt cache; a request's KV comes back to it in `Ended` when it leaves.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from .generation import PROMPT_TAIL, Generation, ResidentModel, _sampling
from .jobs import Job
from .prompt_cache import Fetched
from .scheduler import Row


def batchable_model(model: Any) -> bool:
    """Whether mlx-lm can batch this model: every layer's cache can be merged
    (mlx_lm.server asks the same)."""
    from mlx_lm.models.cache import make_prompt_cache

    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


@dataclass(eq=False)
class Admitted:
    """A request in the batch."""

    job: Job
    generation: Generation
    prompt: list[int]
    fetched: Fetched
    detokenizer: Any
    needs_snapshot: bool  # its KV cannot be cut back: kept at the prompt's boundary for the prompt cache
    admitted_at: float = field(default_factory=time.monotonic)
    snapshot: list[Any] | None = None
    first_token_at: float | None = None

    @property
    def row(self) -> Row:
        generated = len(getattr(self.generation, "tokens", ()))
        return Row(len(self.prompt) + generated, self.job.params.max_tokens - generated)


@dataclass(frozen=True)
class Ended:
    """A request that left the batch, with its KV for the prompt cache."""

    admitted: Admitted
    finish: str
    kv: list[Any] | None  # the KV of `covered`
    covered: list[int]


class BatchRun:
    def __init__(self, resident: ResidentModel, slots: int, prefill_step_size: int) -> None:
        from mlx_lm.generate import BatchGenerator

        self.resident = resident
        eos = sorted(resident.tokenizer.eos_token_ids)
        self.generator = BatchGenerator(resident.model, stop_tokens=[[t] for t in eos],
                                        completion_batch_size=slots, prefill_batch_size=slots,
                                        prefill_step_size=prefill_step_size)
        self.rows: dict[int, Admitted] = {}
        # One sampler object per setting: rows that share it are sampled in one call.
        self._samplers: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def jobs(self) -> list[Job]:
        return [a.job for a in self.rows.values()]

    def close(self) -> None:
        self.generator.close()

    def admit(self, admitted: Admitted, kv: list[Any] | None) -> None:
        """Into the batch: its prompt after the cached part is prefilled with
        the other joining requests', then it decodes with the rest."""
        job, prompt, start = admitted.job, admitted.prompt, admitted.fetched.start
        p = job.params
        sampler, processors = _sampling(p, self.resident.vocab_size())
        key = (p.temperature, p.top_p, p.min_p, p.top_k)
        sampler = None if p.temperature == 0 else self._samplers.setdefault(key, sampler)  # None: greedy
        rest = prompt[start:]
        if admitted.needs_snapshot and len(rest) == 1:
            admitted.snapshot = copy.deepcopy(kv)  # the cache already holds the prompt's boundary
        admitted.generation.waits_for_reader = False
        admitted.generation.begin(prompt[-PROMPT_TAIL:])
        (uid,) = self.generator.insert_segments([[rest]], max_tokens=[p.max_tokens], caches=[kv],
                                                all_tokens=[list(prompt[:start])], samplers=[sampler],
                                                logits_processors=[processors])
        self.rows[uid] = admitted

    def step(self) -> list[Ended]:
        """One step of the batch: every decoding request gets a token, the
        joining ones a chunk of prefill. The requests that ended."""
        prompt_responses, responses = self.generator.next()
        for r in prompt_responses:
            a = self.rows.get(r.uid)
            if a is not None and a.needs_snapshot and r.end_of_segment and not r.end_of_prompt:
                (a.snapshot, _), = self.generator.extract_cache([r.uid]).values()
        ended: list[Ended] = []
        for r in responses:
            a = self.rows.get(r.uid)
            if a is None:
                continue
            if a.first_token_at is None:
                a.first_token_at = time.monotonic()
            detok = a.detokenizer
            if r.finish_reason != "stop":
                detok.add_token(r.token)
            if r.finish_reason is not None:
                detok.finalize()
            finish = a.generation.feed(detok.last_segment, r.token, r.finish_reason)
            if r.finish_reason is not None:  # mlx-lm ended it (and took it out of the batch)
                del self.rows[r.uid]
                ended.append(Ended(a, finish or r.finish_reason, r.prompt_cache, list(r.all_tokens)))
            elif finish is not None:
                ended.append(self._remove(r.uid, finish))
        for uid, a in list(self.rows.items()):  # gone before their first token: cancelled in prefill
            if a.job.cancelled.is_set() and a.first_token_at is None:
                ended.append(self._remove(uid, "cancelled"))
        return ended

    def _remove(self, uid: int, finish: str) -> Ended:
        a = self.rows.pop(uid)
        caches = self.generator.remove([uid], return_prompt_caches=True)
        kv, tokens = caches.get(uid, (None, []))
        return Ended(a, finish, kv, list(tokens))

    def remove_all(self) -> list[Admitted]:
        """Every request out (an MLX error: the engine is going down)."""
        rows = list(self.rows.values())
        self.rows.clear()
        return rows
