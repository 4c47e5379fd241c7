"""The resident model's decoder, as the runner drives it.

- the batch (engine/model/batch_decoder.py): every text request, decoded a
  token a step with the others running (engine/model/row_batch.py); a
  request alone is a batch of one. Speculation (prompt lookup, a draft
  model), grammars, penalties, quantised KV and hybrid caches are each a
  per-row part of the same step.
- a vision row (engine/model/vision_row.py): a vision model's request,
  decoded by mlx-vlm's generation, one at a time.

`Decoders.admit` puts a request in; `step` advances every running request
by one token (or a verify's several) and returns those that ended, each
with its KV for the prompt cache. Which requests are decoded alone (nobody
joins them: a seed, a rank group, `max_concurrency` = 1, a vision model)
is the core's decision (engine/core/scheduler.py); their KV is counted as a
grant of their own, the others' as the batch's rows. What
a decoder holds and hands back (`Admitted`, `Ended`) is
engine/model/decoder_rows.py's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .batch_decoder import BatchDecoder
from .decoder_rows import Admitted, Ended, RowSampling
from .faults import FaultInjector
from .generation import PROMPT_TAIL, ResidentModel, VisionPrompt
from .prefill_pace import PrefillPace
from .vision_row import VisionRow

if TYPE_CHECKING:  # (they import MLX: the engine's entry point must not, before its BLAS choice)
    from .draft_model import DraftModel
    from .ranks import RankLink


class Decoders:
    """The batch and the vision row of the resident model (see the module's docstring)."""

    def __init__(self, resident: ResidentModel, pace: PrefillPace, faults: FaultInjector | None,
                 link: RankLink | None = None, speculative: str = "off", draft: DraftModel | None = None,
                 draft_tokens: int = 3, rows_apart: bool = True, verify_together: bool = False,
                 mixed_prefill: bool = False) -> None:
        self.resident = resident
        self.pace = pace
        self.draft = draft
        self.vision: VisionRow | None = None  # a vision model's request
        self.batch = BatchDecoder(resident, pace, faults, apart=rows_apart, verify_together=verify_together,
                                  speculative=speculative, draft=draft, draft_tokens=draft_tokens, link=link,
                                  mixes=mixed_prefill, aligned=mixed_prefill and resident.kv.coarse_steps)
        self._samplers: dict[tuple, Any] = {}  # one sampler object per setting: rows that share it sample in one call

    @property
    def rows(self) -> list[Admitted]:
        rows = [self.vision.admitted] if self.vision is not None else []
        return rows + list(self.batch.rows.values())

    @property
    def batch_rows(self) -> list[Admitted]:
        """The rows whose KV the ledger counts as the batch's (the others hold grants of their own)."""
        return [a for a in self.batch.rows.values() if not a.alone]

    def sampling(self, admitted: Admitted, vision: bool = False) -> RowSampling:
        from mlx_lm.sample_utils import make_sampler

        from .sampling import make_sampling

        p = admitted.job.params
        sampler, processors = make_sampling(p, self.resident.vocab_size())
        key = (p.temperature, p.top_p, p.min_p, p.top_k)
        sampler = None if p.temperature == 0 else self._samplers.setdefault(key, sampler)
        grammar = admitted.generation.grammar  # applied last, after penalties: it needs only the last token
        if grammar is not None:
            processors = processors + [grammar]  # the batch's step drives it by hand (engine/model/row_batch.py)
            if vision:  # mlx-vlm calls it as a logits processor: its sampler tapped for the token it draws
                sampler = grammar.sampling(sampler or make_sampler(0.0))
        return RowSampling(sampler, processors)

    def admit(self, admitted: Admitted, kv: list[Any] | None, vision: VisionPrompt | None = None) -> None:
        """Into the batch, or the vision row."""
        admitted.generation.waits_for_reader = admitted.alone  # a slow reader holds nobody else up
        admitted.generation.begin(vision.tokens if vision is not None else admitted.prompt[-PROMPT_TAIL:])
        sampling = self.sampling(admitted, vision is not None)
        if vision is not None:
            assert self.vision is None and not self.batch.rows, "a vision request with others running"
            self.vision = VisionRow(self.resident, admitted, sampling, self.pace, vision)
        else:
            self.batch.admit(admitted, kv, sampling)
        admitted.joined_at = time.monotonic()

    def step(self) -> list[Ended]:
        """One step: a token for every decoding request (after a chunk of a
        joining request's prompt). Those that ended."""
        if self.vision is not None:
            ended = self.vision.step()
            if ended:
                self.vision = None
        else:
            ended = self.batch.step()
        return ended

    def close(self) -> None:
        if self.vision is not None:
            self.vision.close()
            self.vision = None
        self.batch.close()
        if self.draft is not None:
            self.draft.close()
