"""A vision model's request: decoded by mlx-vlm's generation, one at a time
(its processor's tensors, its model's own attention; no prompt cache). Text
models' requests are the batch's (engine/model/batch_decoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .decoder_rows import Admitted, Ended, RowSampling
from .generation import ResidentModel, VisionPrompt
from .prefill_pace import PrefillPace


@dataclass(frozen=True)
class _Step:
    text: str
    token: int | None
    finish_reason: str | None


def _closing_step_holds_no_token(results: Any) -> Any:
    """mlx-vlm's stream: per token a result, then one closing result that
    repeats the last token with the detokenizer's rest and the finish reason
    (mlx-lm's puts the finish reason on the last token's own result)."""
    for r in results:
        if r.finish_reason is not None:
            yield _Step(r.text, None, r.finish_reason)
            return
        yield _Step(r.text, int(r.token), None)


class VisionRow:
    def __init__(self, resident: ResidentModel, admitted: Admitted, sampling: RowSampling, pace: PrefillPace,
                 vision: VisionPrompt) -> None:
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler
        from mlx_vlm import stream_generate

        self.admitted = admitted
        if admitted.job.params.seed is not None:  # served alone: its answer is the same every time
            mx.random.seed(admitted.job.params.seed)
        self.steps = _closing_step_holds_no_token(stream_generate(
            resident.model, resident.processor, "", max_tokens=admitted.job.params.max_tokens,
            sampler=sampling.sampler or make_sampler(0.0), logits_processors=sampling.processors or None,
            prefill_step_size=pace.step(), **vision.inputs))

    def step(self) -> list[Ended]:
        """One token (none: the request ended before its first, its client gone)."""
        a = self.admitted
        if a.job.cancelled.is_set() and a.first_token_at is None:
            return [self._end("cancelled")]
        try:
            out = next(self.steps)
        except StopIteration:
            return [self._end("length")]
        finish = a.feed(out.token, out.text, out.finish_reason)
        if out.finish_reason is not None:
            finish = finish or "length"
        return [self._end(finish)] if finish is not None else []

    def _end(self, finish: str) -> Ended:
        self.close()
        return Ended(self.admitted, finish, None)

    def close(self) -> None:
        self.steps.close()
