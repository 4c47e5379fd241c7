"""The runner: the resident model and its decoders, the engine core's one
way to MLX. Every MLX call the core needs goes through it: load and unload
(with the serving plan decided at load), a request's tokens, its KV from the
prompt cache's fetch (recomputed spans, allocation), admission into a
decoder, one decode step, MLX's memory figures and limit.

The core (engine/core/engine_core.py) decides; the runner does. A test drives the
core with a runner of its own that makes no MLX call (tests/engine/test_engine_core.py).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from .decoder_rows import Admitted, Ended
from .decoding import Decoders
from .errors import EngineError
from .faults import FaultInjector
from .context_overflow import Truncation
from .generation import Generation, ResidentModel, VisionPrompt, tokenize, vision_prompt
from .job import Job
from .model_registry import ModelRegistry
from .prefill_pace import PrefillPace
from .rerank_decisions import RerankWork
from ..cache.prompt_cache_policy import Fetched
from .serving_plan import ServingPlan, serving_plan
from .mlx_memory import MemorySnapshot

log = logging.getLogger("mlxd.engine.core.worker")


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as the model takes it."""

    tokens: list[int]
    vision: VisionPrompt | None = None
    truncation: Truncation | None = None  # what context_overflow = "truncate_middle" dropped

    @property
    def image_tokens(self) -> int:
        return self.vision.image_tokens if self.vision is not None else 0


class NeedsModel(Exception):
    """A chat-model reranker's model is not the resident one."""

    def __init__(self, model_id: str) -> None:
        super().__init__(model_id)
        self.model_id = model_id


class ModelRunner:
    def __init__(self, registry: ModelRegistry, faults: FaultInjector, max_prompt_tokens: int,
                 prefill_step_size: int, prefill_step_budget_s: float, heartbeat: Callable[..., None],
                 link: Any = None) -> None:
        self.registry = registry
        self.faults = faults
        self.max_prompt_tokens = max_prompt_tokens
        self.prefill_step_size = prefill_step_size
        self.prefill_step_budget_s = prefill_step_budget_s
        self.heartbeat = heartbeat
        self.link = link  # rank 0 of a rank group (engine/model/ranks.py): loads and forward passes are mirrored
        # The core's: a long prompt's KV so far, to the prompt cache's disk tier (Admitted.save_progress).
        self.save_progress: Callable[[Admitted, list[Any], int], None] | None = None
        self.pace = PrefillPace(prefill_step_size, prefill_step_budget_s)  # measured anew per model
        self.resident: ResidentModel | None = None
        self.plan: ServingPlan | None = None
        self.decoders: Decoders | None = None
        self._wired_before: int | None = None
        self.encoder: Any = None  # the embedding model (engine/model/encoder.py), resident beside the chat model
        self.reranker: Any = None  # the cross-encoder reranker (engine/model/reranker.py), likewise

    @property
    def resident_id(self) -> str | None:
        return self.resident.model_id if self.resident is not None else None

    # --- the model --------------------------------------------------------------
    def load(self, model_id: str) -> ServingPlan:
        """The model into memory and its serving plan; an EngineError (503)
        for a load that failed outside MLX (missing files, no network)."""
        from .model_load import load_resident, load_shard, with_kv_layout
        from .row_attention import rows_decode_exact, segments_exact

        info = self.registry.info(model_id)
        target = self.registry.load_target(model_id)
        log.info("loading model %s from %s", model_id, target)
        try:
            resident = (load_resident(model_id, target, info.weights_dtype,
                                      self.registry.config.models[model_id].extend_context) if self.link is None
                        else load_shard(model_id, target, self.link))
        except (OSError, ValueError, KeyError, ImportError) as exc:
            raise EngineError(503, f"could not load model {model_id!r}: {exc}", code="model_load_failed",
                              param="model", retry_after=30) from exc
        if not resident.vision and self.link is None:
            resident = with_kv_layout(resident, info.kv)
        self.resident = resident
        self.pace = PrefillPace(self.prefill_step_size, self.prefill_step_budget_s)
        concurrency = self.registry.max_concurrency(model_id)
        batching = self.registry.config.engine.batching
        text_alone = not resident.vision and self.link is None
        # A batch of one needs neither check: its forward is the model's over the row's own cache.
        rows_apart, verify_together = (rows_decode_exact(resident.model) if text_alone and concurrency > 1
                                       else (True, False))
        # Joining prompts' chunks in the decode steps: not over quantised KV (a prefill quantises as it goes), and
        # only where every layer's cache is a plain KVCache (segments_exact checks it), as every row's then is.
        mixed = text_alone and concurrency > 1 and rows_apart and not resident.kv.quantized and \
            segments_exact(resident.model)
        speedup = None
        if text_alone and concurrency > 1 and rows_apart and batching == "auto" and not self.registry.on_cpu:
            speedup = self._batch_speedup(model_id, resident, min(4, concurrency), verify_together)
        self.plan = serving_plan(model_id, concurrency, vision=resident.vision, rank_group=self.link is not None,
                                 kv=resident.kv, cpu_float32=info.weights_dtype == "float32",
                                 speculative=self.registry.config.speculative_for(model_id), rows_apart=rows_apart,
                                 batch_speedup=speedup, batching=batching, on_cpu=self.registry.on_cpu,
                                 mixed_prefill=mixed)
        if self.plan.reason and self.registry.max_concurrency(model_id) > 1:
            log.info("%s is served one request at a time: %s", model_id, self.plan.reason)
        spec = self.registry.config.models[model_id]
        draft = self._load_draft(model_id, spec.draft, resident) if self.plan.speculative == "draft" else None
        self.decoders = Decoders(resident, self.pace, self.faults, self.link,
                                 speculative=self.plan.speculative, draft=draft, draft_tokens=spec.draft_tokens,
                                 rows_apart=self.plan.rows_apart, verify_together=verify_together,
                                 mixed_prefill=self.plan.mixed_prefill)
        from mlx_lm.utils import maybe_set_recommended_wired_limit  # Metal: the weights stay wired, as mlx-lm does

        self._wired_before = maybe_set_recommended_wired_limit()
        return self.plan

    def _batch_speedup(self, model_id: str, resident: ResidentModel, rows: int, verify_together: bool) -> float:
        """A batched step's tokens a second against one row's (engine/model/batch_probe.py): plain
        steps, and verify steps where its rows speculate together; the lesser."""
        from .batch_probe import VERIFY_WIDTH, batch_speedup
        from .serving_plan import speculative_mode

        plain = speedup = batch_speedup(resident.model, rows=rows)
        speculates = speculative_mode(self.registry.config.speculative_for(model_id), vision=False,
                                      rank_group=False) != "off"
        if speculates and verify_together:
            speedup = min(plain, batch_speedup(resident.model, rows=rows, width=VERIFY_WIDTH))
        log.info("%s: a step of %d rows decodes %.2fx the tokens a second of one row alone (%.2fx as plain steps)",
                 model_id, rows, speedup, plain)
        return speedup

    def _load_draft(self, model_id: str, draft_id: str, resident: ResidentModel) -> Any:
        """The model's draft (engine/model/draft_model.py), its tokenizer checked
        against the model's; a load error (503) for one that cannot propose."""
        from .draft_model import DraftModel, same_vocabulary
        from .model_load import load_resident

        target = self.registry.load_target(draft_id)
        log.info("loading %s's draft model %s from %s", model_id, draft_id, target)
        try:
            draft = load_resident(draft_id, target, self.registry.info(draft_id).weights_dtype)
        except (OSError, ValueError, KeyError, ImportError) as exc:  # the core unloads the model (plan_release)
            raise EngineError(503, f"could not load {model_id!r}'s draft model {draft_id!r}: {exc}",
                              code="model_load_failed", param="model", retry_after=30) from exc
        why = same_vocabulary(resident.tokenizer.get_vocab(), draft.tokenizer.get_vocab())
        if why is not None:
            raise EngineError(503, f"{model_id!r}'s draft model {draft_id!r} cannot propose its tokens: {why}",
                              code="model_load_failed", param="model", retry_after=30)
        return DraftModel(draft_id, draft.model)

    def unload(self) -> None:
        import mlx.core as mx

        if self.decoders is not None:
            self.decoders.close()
        self.resident = self.plan = self.decoders = None
        if self._wired_before is not None:
            mx.set_wired_limit(self._wired_before)
            self._wired_before = None
        if self.link is not None:
            from .ranks import UNLOAD

            self.link.share((UNLOAD,))
        gc.collect()
        mx.clear_cache()
        give_heap_back()

    def give_heap_back(self) -> None:
        give_heap_back()

    # --- the embedding model -------------------------------------------------------
    def load_encoder(self, model_id: str) -> Any:
        """The embedding model `model_id`, loaded unless it is the one resident
        (one at a time); an EngineError (503) for a load that failed outside MLX."""
        from .encoder import Encoder

        if self.encoder is None or self.encoder.model_id != model_id:
            self.encoder = None  # one at a time: the other's buffers go before this one's load
            self.encoder = self._load_side("embedding model", model_id, self.registry.embedding_folder, Encoder)
            log.info("embedding model %s: %d dimensions, inputs up to %d tokens", model_id,
                     self.encoder.limits.dimensions, self.encoder.limits.max_tokens)
        return self.encoder

    def _load_side(self, kind: str, model_id: str, folder_of: Callable[[str], Any], build: Callable[..., Any]) -> Any:
        """A side model (an encoder, a cross-encoder) from its folder; an EngineError (503) for a load that failed
        outside MLX."""
        gc.collect()
        folder = folder_of(model_id)
        log.info("loading %s %s from %s", kind, model_id, folder)
        try:
            loaded = build(model_id, folder)
        except (OSError, ValueError, KeyError, ImportError) as exc:
            raise EngineError(503, f"could not load {kind} {model_id!r}: {exc}", code="model_load_failed",
                              param="model", retry_after=30) from exc
        log.info("loaded %s %s in %.2fs", kind, model_id, loaded.load_s)
        return loaded

    def unload_encoder(self) -> None:
        """The side models (the embedding model, the cross-encoder) out of memory."""
        if self.encoder is None and self.reranker is None:
            return
        import mlx.core as mx

        self.encoder = self.reranker = None
        gc.collect()
        mx.clear_cache()

    # --- rerankers ---------------------------------------------------------------
    def load_reranker(self, reranker_id: str) -> Any:
        """The cross-encoder `reranker_id`, loaded unless it is the one
        resident; an EngineError (503) for a load that failed outside MLX."""
        from .reranker import CrossEncoder

        if self.reranker is None or self.reranker.model_id != reranker_id:
            self.reranker = None
            self.reranker = self._load_side("reranker", reranker_id, self.registry.reranker_folder, CrossEncoder)
        return self.reranker

    def start_rerank(self, reranker_id: str, work: RerankWork) -> Any:
        """A rerank request's forwards (stepped by the core's side turn) on
        the model its reranker names; NeedsModel where that is a chat model
        not resident (the core loads it once no answer is running)."""
        from .reranker import ChatRerankRun, CosineRun, cut_documents

        spec = self.registry.config.rerankers[reranker_id]
        if spec.embedding is not None:
            if work.instruction is not None:
                raise EngineError(400, "instruction: this reranker ranks by embeddings and takes no instruction (a "
                                       "chat-model reranker does)", code="invalid_request", param="instruction")
            encoder = self.load_encoder(spec.embedding)
            texts = [work.query, *cut_documents(encoder.tokenizer, work.documents, work.max_tokens_per_doc)]
            return CosineRun(encoder.start(encoder.tokenize(texts, truncate=True)))
        if spec.chat_model is not None:
            model_id = self.registry.config.resolve(spec.chat_model)
            if self.resident is None or self.resident.model_id != model_id:
                raise NeedsModel(model_id)  # type: ignore[arg-type]
            if self.resident.processor is not None or self.link is not None:
                raise EngineError(400, f"the reranker {reranker_id!r} needs a text model served by one process; "
                                       f"{model_id!r} is a vision model or a rank group", code="invalid_request",
                                  param="model")
            return ChatRerankRun(self.resident.model, self.resident.tokenizer, work,
                                 work.instruction or spec.instruction, self.max_prompt_tokens)
        return self.load_reranker(reranker_id).start(work)

    def reset_peak(self) -> None:
        import mlx.core as mx

        mx.reset_peak_memory()

    def generation_prompt_length(self) -> int:
        from .prompt_tokens import generation_prompt_length

        return generation_prompt_length(self.resident.tokenizer)

    # --- a request ----------------------------------------------------------------
    def can_batch(self, job: Job) -> bool:
        """What may join the batch: the resident model's plan allows it, no
        seed, no image, not a suspect of a crash; the rest is decoded alone."""
        plan = self.plan
        return (plan is not None and plan.model_id == job.model_id and plan.max_concurrency > 1
                and job.params.seed is None and not job.images and not job.alone)

    def tokenize(self, job: Job) -> Prompt:
        """The request's prompt on the resident model; the 400 for one it cannot take."""
        if self.resident.vision:
            vision = vision_prompt(self.resident, job, self.max_prompt_tokens)
            return Prompt(vision.tokens, vision)
        tokens, truncation = tokenize(self.resident, job, self.max_prompt_tokens)
        return Prompt(tokens, truncation=truncation)

    def admit(self, job: Job, prompt: Prompt, fetched: Fetched, cache_enabled: bool, alone: bool,
              taken_at: float) -> Admitted:
        """Its KV from what the prompt cache fetched (spans recomputed; else
        allocated once for prompt and answer), then into its decoder
        (`alone`: nobody joins it, its KV a grant of its own)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        from ..cache.kv_cache import make_kv
        from .prefill import recompute
        from ..cache.prompt_cache_policy import needs_boundary_snapshot

        r = self.resident
        kv = fetched.kv
        if fetched.patches:
            recompute(r.model, kv, prompt.tokens, fetched.patches, fetched.start, self.pace, self.heartbeat,
                      cancelled=job.cancelled)
        needs_snapshot = False
        if prompt.vision is None and self.link is None:
            if kv is None:  # allocated once for its prompt and answer, as admission counted it (engine/cache/kv_cache.py)
                kv = make_kv(r.model, len(prompt.tokens) + job.params.max_tokens, r.kv)
            needs_snapshot = cache_enabled and needs_boundary_snapshot([type(c).__name__ for c in kv],
                                                                       can_trim_prompt_cache(kv))
        generation = Generation(r, job, self.faults, self.heartbeat)
        admitted = Admitted(job, generation, prompt.tokens, fetched, r.tokenizer.detokenizer, needs_snapshot,
                            alone=alone, taken_at=taken_at)
        if self.save_progress is not None and not needs_snapshot and prompt.vision is None and self.link is None:
            admitted.save_progress = self.save_progress
        self.decoders.admit(admitted, kv, prompt.vision)
        admitted.fetched = replace(fetched, kv=None)  # the decoder's row owns the KV now
        return admitted

    def step(self) -> list[Ended]:
        return self.decoders.step() if self.decoders is not None else []

    @property
    def rows(self) -> list[Admitted]:
        return self.decoders.rows if self.decoders is not None else []

    @property
    def batch_rows(self) -> list[Admitted]:
        return self.decoders.batch_rows if self.decoders is not None else []

    def finish(self, e: Ended) -> None:
        """The answer's end, to its client."""
        a = e.admitted
        a.generation.end(e.finish, len(a.prompt), len(a.generation.tokens), a.fetched.cached_tokens)

    def echo(self, generated: list[int]) -> tuple[int, ...]:
        from .prompt_tokens import answer_echo

        return answer_echo(self.resident.tokenizer, generated)

    def describe_reuse(self, cached: list[int], sent: list[int]) -> tuple[str, str]:
        decode = self.resident.tokenizer.decode
        return decode(cached), decode(sent)

    # --- MLX's memory ----------------------------------------------------------------
    def memory(self) -> MemorySnapshot:
        import mlx.core as mx

        return MemorySnapshot(mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory(), time.monotonic())

    def clear_cache(self) -> None:
        import mlx.core as mx

        mx.clear_cache()

    def mlx_bytes(self) -> int:
        import mlx.core as mx

        return mx.get_active_memory() + mx.get_cache_memory()

    def set_memory_limit(self, limit_bytes: int) -> None:
        import mlx.core as mx

        mx.set_memory_limit(limit_bytes)


def give_heap_back() -> None:
    """Freed memory back to the system where the C library keeps it (glibc:
    the weights' and KV's freed CPU buffers stay in its heap, the process's
    RSS with them, until malloc_trim); nothing elsewhere (macOS, musl)."""
    import ctypes
    import sys

    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
