"""The two decoders behind one interface, as the runner drives them.

- one row (engine/model/one_row.py): a request decoded by itself, as mlx-lm decodes
  one (`generate_step`; mlx-vlm's generation for a vision prompt). Every
  request when `max_concurrency` = 1, and what a batch cannot take (a seed,
  an image, a rank group); in a batch, the first request into an empty one
  while nobody waits (a batch of one decodes slower on a GPU: docs/BENCHMARKS.md,
  "Why the engine is built as it is").
- many rows (engine/model/many_rows.py): mlx-lm's BatchGenerator decoding every
  running request by a token a step; a joining request is prefilled by
  itself, a paced chunk between the decode steps.

`Decoders.admit` puts a request in (a lone request moves into the batch
where it stands when a second joins); `step` advances every running request
by one token and returns those that ended, each with its KV for the prompt
cache. A row carries its own sampler and logits processors (penalties, a
grammar: engine/model/constrained.py). Speculative decoding fits the one-row
decoder's step source: mlx-lm's `speculative_generate_step` yields what
`generate_step` does, several tokens verified in one forward. What a decoder
holds and hands back (`Admitted`, `Ended`) is engine/model/decoder_rows.py's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from .decoder_rows import Admitted, Ended, RowSampling
from .faults import FaultInjector
from .generation import PROMPT_TAIL, ResidentModel, VisionPrompt
from .many_rows import ManyRows
from .one_row import OneRow
from .prefill_pace import PrefillPace

if TYPE_CHECKING:  # (they import MLX: the engine's entry point must not, before its BLAS choice)
    from .draft_model import DraftModel
    from .ranks import RankLink

class Decoders:
    """The one-row and many-row decoders of the resident model (see the module's docstring)."""

    def __init__(self, resident: ResidentModel, slots: int, pace: PrefillPace, faults: FaultInjector | None,
                 link: RankLink | None = None, speculative: str = "off", draft: DraftModel | None = None,
                 draft_tokens: int = 3, rows_apart: bool = False, rows_lookup: bool = False) -> None:
        self.resident = resident
        self.rows_apart = rows_apart  # the batch decodes rows over their own caches (engine/model/row_batch.py)
        self.rows_lookup = rows_lookup  # and verifies each row's prompt-lookup proposals in its steps
        self.speculative = speculative  # the serving plan's, for the one-row decoder
        self.draft = draft  # its DraftModel when the plan says "draft" (engine/model/draft_model.py)
        self.draft_tokens = draft_tokens
        self.slots = slots
        self.pace = pace
        self.faults = faults
        self.link = link
        self.one: OneRow | None = None  # the request decoded alone
        self.many: ManyRows | None = None  # made when a second request joins
        self._samplers: dict[tuple, Any] = {}  # one sampler object per setting: rows that share it sample in one call

    @property
    def rows(self) -> list[Admitted]:
        rows = [self.one.admitted] if self.one is not None else []
        return rows + (list(self.many.rows.values()) if self.many is not None else [])

    @property
    def batch_rows(self) -> list[Admitted]:
        """The rows in mlx-lm's batch (and joining it): the memory they hold is the batch's."""
        return list(self.many.rows.values()) if self.many is not None else []

    def decodes_alone(self, alone: bool, others_waiting: bool) -> bool:
        """Whether the next request starts in the one-row decoder: alone by
        need, or into an empty batch with nobody behind it (starts_alone; the
        runner sends one whose cache cannot be cut back to the batch instead)."""
        return alone or self.slots <= 1 or starts_alone(not self.rows, others_waiting)

    def sampling(self, admitted: Admitted) -> RowSampling:
        from mlx_lm.sample_utils import make_sampler

        from .sampling import make_sampling

        p = admitted.job.params
        sampler, processors = make_sampling(p, self.resident.vocab_size())
        key = (p.temperature, p.top_p, p.min_p, p.top_k)
        sampler = None if p.temperature == 0 else self._samplers.setdefault(key, sampler)
        grammar = admitted.generation.grammar  # applied last, after penalties: it needs only the last token
        if grammar is not None:  # its own sampler, tapped for the token it draws (engine/model/constrained.py)
            sampler = grammar.sampling(sampler or make_sampler(0.0))
            processors = processors + [grammar]
        return RowSampling(sampler, processors)

    def admit(self, admitted: Admitted, kv: list[Any] | None, heartbeat: Callable[..., None], one_row: bool,
              vision: VisionPrompt | None = None) -> None:
        """Into a decoder: the one-row decoder (`one_row`, decodes_alone), or
        the batch, which a request decoding alone joins first."""
        admitted.generation.waits_for_reader = admitted.alone  # a slow reader holds nobody else up
        admitted.generation.begin(vision.tokens if vision is not None else admitted.prompt[-PROMPT_TAIL:])
        sampling = self.sampling(admitted)
        if one_row:
            assert self.one is None and self.many_empty, "a request decoded alone with others running"
            self.one = OneRow(self.resident, admitted, kv, sampling, self.pace, self.faults, heartbeat,
                              vision=vision, link=self.link, speculative=self.speculative, draft=self.draft,
                              draft_tokens=self.draft_tokens)
            admitted.joined_at = time.monotonic()
            return
        many = self._many()
        if self.one is not None:
            one, self.one = self.one, None
            many.take_over(one.hand_over())
        many.admit(admitted, kv, sampling)
        admitted.joined_at = time.monotonic()

    @property
    def many_empty(self) -> bool:
        return self.many is None or not self.many.rows

    def _many(self) -> Any:
        if self.many is None:
            self.many = ManyRows(self.resident, self.slots, self.pace, self.faults, rows_apart=self.rows_apart,
                                 rows_lookup=self.rows_lookup)
        return self.many

    def step(self) -> list[Ended]:
        """One step: a token for every decoding request (the one alone, or the
        batch's, after a chunk of a joining request's prompt). Those that ended."""
        if self.one is not None:
            ended = self.one.step()
            if ended:
                self.one = None
            return ended
        return self.many.step() if self.many is not None else []

    def close(self) -> None:
        if self.one is not None:
            self.one.close()
            self.one = None
        if self.many is not None:
            self.many.close()
            self.many = None
        if self.draft is not None:
            self.draft.close()


def starts_alone(batch_empty: bool, others_waiting: bool) -> bool:
    """Whether a request may be decoded alone, as mlx-lm decodes one (pure):
    into an empty batch, and only when nobody waits behind it (its cache
    must also be one mlx-lm can cut back when a second request joins:
    engine/model/runner.py checks that). A burst (agents started together) joins
    the batch: the lone start prefills its whole prompt in one go, holding
    the others in the queue, and the burst's last first token comes later
    (docs/BENCHMARKS.md, "Why the engine is built as it is")."""
    return batch_empty and not others_waiting
