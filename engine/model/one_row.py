"""The one-row decoder: a request decoded by itself, as mlx-lm decodes one.

Its prompt, after the cached part, is prefilled at the engine's pace
(engine/model/prefill.py: each step a heartbeat, quantised past kv_bits' start,
cancellable), kept at the prompt's boundary where its cache cannot be cut
back (for the prompt cache), then mlx-lm's `generate_step` decodes from the
last prompt token over the request's KV, allocated once at its admitted
length. A vision prompt goes through mlx-vlm's generation instead (its
processor's tensors, no prompt cache); a rank group's forward passes are
mirrored by the other ranks between BEGIN and END (engine/model/ranks.py).

Speculative decoding lands here, not in a third loop: `verify_greedy` is its
step (several proposed tokens verified in one forward over the row's own
KV), and a step source that proposes tokens (engine/model/speculative.py's
prompt lookup, engine/model/draft_model.py's draft) yields what
`generate_step` yields. A request with no penalties between the logits and
the draw (a grammar composes) is decoded so when the serving plan says so:
greedy, the same tokens; sampled, the same distribution (the speculative
acceptance rule).

In a batch, the request decoding alone moves into mlx-lm's batch where it
stands when a second one joins (`hand_over`): its KV, cut back by the token
whose forward pass mlx-lm has already queued, and its last token go in as a
one-token prompt; its sampler, detokenizer and Generation carry on (greedy
answers are the same tokens; tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .decoder_rows import CHECKPOINT_TOKENS, Admitted, Ended, RowSampling
from .faults import FaultInjector
from .generation import ResidentModel, VisionPrompt
from .prefill_pace import PrefillPace
from .sampling import seeing_context

if TYPE_CHECKING:  # (they import MLX: the engine's entry point must not, before its BLAS choice)
    from .draft_model import DraftModel
    from .ranks import RankLink


@dataclass(frozen=True)
class Joining:
    """A request handed from one decoder to the batch: what mlx-lm's insert takes."""

    admitted: Admitted
    segment: list[int]  # the tokens still to run through the model (its last prompt token, or last token)
    kv: list[Any]
    context: list[int]  # the tokens its KV holds
    max_tokens: int  # tokens it may still generate
    sampling: RowSampling


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


def verify_greedy(model: Any, kv: list[Any], last: int, proposed: list[int], masks: Any = None) -> list[int]:
    """The speculative step (greedy): `last` (the row's newest token, its KV
    not in `kv` yet) and `proposed` tokens run through the model in one
    forward (each position's logits under its grammar mask, `masks`, where
    the answer has a grammar); the longest prefix of `proposed` the model
    itself would have chosen is accepted, then the model's own next token. What a greedy decode
    yields from here, one to len(proposed) + 1 tokens, exactly. `kv` keeps the
    positions of `last` and the accepted tokens (the rest are cut back: the
    KV was allocated at admission, nothing grows); the last token returned
    goes into the next step, as a decoded token does."""
    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    from .speculative import apply_masks, greedy_choice

    logits = apply_masks(model(mx.array([[last, *proposed]], dtype=mx.int32), cache=kv)[0], masks)
    choice = greedy_choice(logits).tolist()  # the model's pick after each position, as generate_step picks
    accepted = 0
    while accepted < len(proposed) and proposed[accepted] == choice[accepted]:
        accepted += 1
    if len(proposed) > accepted:
        trim_prompt_cache(kv, len(proposed) - accepted)
    return proposed[:accepted] + [choice[accepted]]


class OneRow:
    def __init__(self, resident: ResidentModel, admitted: Admitted, kv: list[Any] | None, sampling: RowSampling,
                 pace: PrefillPace, faults: FaultInjector | None, heartbeat: Callable[..., None],
                 vision: VisionPrompt | None = None, link: RankLink | None = None, speculative: str = "off",
                 draft: DraftModel | None = None, draft_tokens: int = 3) -> None:
        import mlx.core as mx

        self.resident = resident
        self.speculative = speculative
        self.draft = draft  # DraftModel (engine/model/draft_model.py) when the plan says "draft"
        self.draft_tokens = draft_tokens
        self.spec_stats: Any = None  # SpecStats, when this request is decoded speculatively
        self.admitted = admitted
        self.sampling = sampling
        self.link = link
        self.yielded = 0
        self.vision = vision is not None
        job = admitted.job
        if job.params.seed is not None:  # served alone: its answer is the same every time
            mx.random.seed(job.params.seed)
        if vision is not None:
            self.kv, self.context, self.rest = None, [], []
            self.steps = self._vision_steps(vision, pace)
            return
        if link is not None:
            from .ranks import BEGIN

            link.share((BEGIN,))  # the other ranks keep a KV cache of their own shard until END
        self.steps: Any = iter(())
        try:
            self._start(kv, pace, faults, heartbeat)
        except BaseException:
            self.close()
            raise

    def _start(self, kv: list[Any] | None, pace: Any, faults: Any, heartbeat: Callable[..., None]) -> None:
        resident, admitted = self.resident, self.admitted
        job = admitted.job
        if kv is None:  # a rank group's shard: no prompt cache of ours
            from mlx_lm.models.cache import make_prompt_cache

            kv = make_prompt_cache(resident.model)
        start, rest = admitted.fetched.start, admitted.prompt[admitted.fetched.start:]
        if len(rest) > 1:  # at the engine's pace (generate_step's one step size would be the first step's)
            from .prefill import prefill

            body = rest[:-1]
            for at in range(0, len(body), CHECKPOINT_TOKENS):  # a long prompt's KV to disk as it goes
                segment = body[at:at + CHECKPOINT_TOKENS]
                prefill(resident.model, kv, segment, pace, heartbeat, faults, resident.kv, cancelled=job.cancelled)
                if at + len(segment) < len(body) and admitted.save_progress is not None:
                    admitted.save_progress(admitted, kv, start + at + len(segment))
            start, rest = start + len(rest) - 1, rest[-1:]
            admitted.prefilled = (kv, start)
        if admitted.needs_snapshot:
            from ..cache.kv_cache import fitted

            admitted.snapshot = fitted(kv, copy_others=True)  # the cache holds the prompt's boundary now
        self.kv, self.context, self.rest = kv, admitted.prompt[:start], rest
        self.steps = self._text_steps(heartbeat)

    def _text_steps(self, heartbeat: Callable[..., None]) -> Any:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        s, context = self.sampling, self.context
        processors = [p if p is self.admitted.generation.grammar else seeing_context(p, context)
                      for p in s.processors] if context else s.processors
        layout, kv = self.resident.kv, self.kv
        quantize = {"kv_bits": layout.bits, "kv_group_size": layout.group_size,
                    "quantized_kv_start": layout.quantized_start} if layout.quantized else {}
        # The serving plan is "off" for quantised KV (engine/model/serving_plan.py): nothing to check here.
        if self.speculative == "draft" and self.draft is not None and not s.processors:
            from .draft_model import draft_steps
            from .speculative import SpecStats

            # The draft proposes, the model verifies (mlx-lm's speculative_generate_step): its own tokens.
            self.spec_stats = SpecStats(mode="draft")
            return draft_steps(self.resident.model, kv, self.draft, self.rest, context,
                               self.admitted.job.params.max_tokens, s.sampler, self.draft_tokens, self.spec_stats)
        grammar = self.admitted.generation.grammar
        penalties = [q for q in s.processors if q is not grammar]
        # Under a harmony grammar prompt lookup ended bound answers after the analysis channel's forced markers (the
        # model zoo's gpt-oss, an open bug): those decode a token a forward, as with speculative = "off".
        harmony_bound = grammar is not None and getattr(self.resident.tool_format, "body", None) == "harmony"
        if self.speculative == "prompt_lookup" and not penalties and not harmony_bound:
            from .speculative import SampledTarget, SpecStats, lookup_steps, verify_sampled

            # Nothing between the logits and the draw but a grammar (no penalties: they see each token before):
            # greedy answers are the same tokens, sampled ones drawn from the same distribution (the speculative
            # acceptance rule); a grammar masks every position, proposals cut where it would not allow them.
            p = self.admitted.job.params
            sampled = SampledTarget.of(p, self.resident.vocab_size())
            self.spec_stats = SpecStats()
            return lookup_steps(self.resident.model, kv, self.rest, context, p.max_tokens, self.spec_stats,
                                verify_greedy if sampled is None else verify_sampled(sampled), sampled, grammar)
        if self.resident.dequantized_decode:
            from ..cache.kv_cache import prefill_views

            # Every layer quantised from the first position (the runner made it so): no switch to make.
            kv, quantize = prefill_views(kv), {}
        return generate_step(mx.array(self.rest, dtype=mx.int32), self.resident.model,
                             max_tokens=self.admitted.job.params.max_tokens, sampler=s.sampler or make_sampler(0.0),
                             logits_processors=processors, prompt_cache=kv, prompt_progress_callback=heartbeat,
                             **quantize)

    def _vision_steps(self, vision: Any, pace: Any) -> Any:
        from mlx_lm.sample_utils import make_sampler
        from mlx_vlm import stream_generate

        s = self.sampling
        return _closing_step_holds_no_token(stream_generate(
            self.resident.model, self.resident.processor, "", max_tokens=self.admitted.job.params.max_tokens,
            sampler=s.sampler or make_sampler(0.0), logits_processors=s.processors or None, prefill_step_size=pace.step(),
            **vision.inputs))

    def step(self) -> list[Ended]:
        """One token (none: the request ended before its first, its client gone)."""
        a = self.admitted
        if a.job.cancelled.is_set() and a.first_token_at is None:
            return [self._end("cancelled")]
        try:
            out = next(self.steps)
        except StopIteration:
            return [self._end("length")]
        if self.vision:
            finish = a.feed(out.token, out.text, out.finish_reason)
            if out.finish_reason is not None:
                finish = finish or "length"
        else:
            token = int(out[0])
            self.yielded += 1
            model_finish = ("stop" if token in self.resident.tokenizer.eos_token_ids
                            else "length" if self.yielded >= a.job.params.max_tokens else None)
            finish = a.feed(token, None, model_finish)
        return [self._end(finish)] if finish is not None else []

    def hand_over(self) -> Joining:
        """Out of this decoder, to join the batch where it stands (see the module's docstring)."""
        from mlx_lm.models.cache import trim_prompt_cache

        self.steps.close()
        a = self.admitted
        if self.yielded == 0:  # not started: it joins as any request does
            return Joining(a, self.rest, self.kv, self.context, a.job.params.max_tokens, self.sampling)
        # mlx-lm has already run the last token through the model: its KV goes,
        # and the token comes back as a one-token prompt (which its grammar has already consumed).
        # Prompt lookup may have run tokens past it (a verify's accepted tokens not taken yet): they go too.
        if self.spec_stats is not None:
            self._trim_speculated()
        else:
            trim_prompt_cache(self.kv, 1)
        if a.generation.grammar is not None:
            a.generation.grammar.repeat_last()
        generated = a.generation.tokens
        return Joining(a, generated[-1:], self.kv, a.prompt + generated[:-1],
                       a.job.params.max_tokens - self.yielded, self.sampling)

    def _end(self, finish: str) -> Ended:
        self.close()
        if self.spec_stats is not None:
            self._trim_speculated()
        return Ended(self.admitted, finish, None if self.vision or self.link is not None else self.kv,
                     self.spec_stats)

    def _trim_speculated(self) -> None:
        """A verify may have run tokens past where the answer ended (a stop, its
        length) or where it leaves for the batch: the KV keeps the prompt and
        the answer but its last token, as generate_step's does; a draft keeps
        its KV for the next request's common prefix."""
        from mlx_lm.models.cache import trim_prompt_cache

        from ..cache.prompt_cache import kv_offset

        a = self.admitted
        keep = len(a.prompt) + max(0, len(a.generation.tokens) - 1)
        held = kv_offset(self.kv) if self.kv else None
        if held is not None and held > keep:
            trim_prompt_cache(self.kv, held - keep)
        if self.spec_stats.mode == "draft":
            self.draft.ended(a.prompt + a.generation.tokens)

    def close(self) -> None:
        close = getattr(self.steps, "close", None)
        if close is not None:
            close()
        if self.link is not None:
            from .ranks import END

            self.link.share((END,))
            self.link = None
