"""An embedding model (an encoder) and its forwards: `/v1/embeddings`' model.

mlx-vlm's encoders (MIT: BERT, ModernBERT, XLM-R, Qwen3-Embedding, Gemma
embeddings...) are loaded as a sentence-transformers folder holds them
(`load_embedding_model`); the tokenizer is the folder's own (transformers).
Inputs are tokenized whole: one longer than the model's limit is refused
(400) unless the request asks to truncate, as sentence-transformers would
silently. The forwards are batched by length
(`plan_batches`, pure): sorted, so rows of one forward are padded little, and
bounded in padded tokens, so a forward's memory is bounded whatever the
request. Runs on the worker thread only (engine/core/engine_core.py), beside
the resident chat model (docs/DESIGN.md, "Embeddings beside the chat model").

The vector is what sentence-transformers gives on the same folder
(`pooling_plan`, pure): the model's last hidden states pooled here as
`1_Pooling/config.json` says (cls, mean, max, mean_sqrt_len_tokens,
weightedmean, lasttoken: a decoder embedder such as Qwen3-Embedding pools its
last token, the <|endoftext|> its tokenizer appends), and made unit length
only where `modules.json` lists a Normalize module -- so a model without one
answers /v1/embeddings with vectors that are not unit length, as
sentence-transformers does (mlx-vlm's own `text_embeds` are always
normalised). A folder with other modules (Dense heads: EmbeddingGemma) keeps
mlx-vlm's `text_embeds`, which apply them. A folder with no
sentence-transformers files pools as sentence-transformers' fallback does
(the last token of a causal LM's architecture, else the mean) but is
normalised: there the files state nothing, model cards and OpenAI's
embeddings are unit vectors, and the cosine is sentence-transformers' all the
same. tests/engine/test_pooling.py checks each pooling against
sentence-transformers on tiny folders (mlxd.devkit.tiny_encoders).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_vlm.embedding_loader import load_embedding_model

from mlxd.api_errors import INVALID_REQUEST

from .errors import EngineError

log = logging.getLogger("mlxd.engine.model.encoder")

# A forward's padded tokens and attention-score elements (rows x heads x length^2): what it holds is bounded.
# On a GPU large forwards fill the device; on the CPU small ones are faster (arrays that stay in the caches:
# 512 tokens a forward made 1.6x the inputs a second of 8,192, all-MiniLM-L6-v2 on 2 cores), and forwards
# go in pairs, one per core, on CPU streams of their own (MLX's elementwise kernels use one core each).
FORWARD_BOUNDS = {"gpu": (8192, 32 * 2**20), "cpu": (512, 4 * 2**20)}
LENGTH_BUCKET = 8  # lengths padded to a multiple: fewer distinct shapes (MLX plans and compiles per shape)
# sentence-transformers' pooling modes: its 1_Pooling/config.json's `pooling_mode`, or a legacy flag of each.
POOLING_MODES = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
                 "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
                 "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
POOLED_HERE = {"Transformer", "Pooling", "Normalize"}  # modules.json's modules this file applies itself


@dataclass(frozen=True)
class PoolingPlan:
    mode: str | None  # pooled here from the last hidden states; None: the model's own text_embeds
    normalize: bool  # made unit length
    why: str  # for the load's log line


def default_pooling(config: dict) -> str:
    """sentence-transformers' pooling for a folder without its files (pure):
    the last token of a causal LM (unless `is_causal` is false), else the mean."""
    architectures = config.get("architectures") or [""]
    causal = architectures[0].endswith("ForCausalLM") and bool(config.get("is_causal", True))
    return "lasttoken" if causal else "mean"


def pooling_mode(pooling: dict) -> str:
    """The one mode of a 1_Pooling/config.json (pure); ValueError for what is
    not one of sentence-transformers' modes, or several concatenated."""
    mode = pooling.get("pooling_mode")
    if mode is None:
        mode = [name for name, flag in POOLING_MODES.items() if pooling.get(flag)] or ["mean"]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"1_Pooling/config.json asks for the pooling {mode!r}; mlxd pools with one of "
                         f"{sorted(POOLING_MODES)}")
    return modes[0]


def pooling_plan(modules: list[dict] | None, pooling: dict | None, config: dict) -> PoolingPlan:
    """How an encoder folder's vector is made (pure), from its modules.json,
    1_Pooling/config.json and config.json (None where absent): as
    sentence-transformers makes it, except that a folder with none of its
    files is normalised (the module docstring says why)."""
    mode = pooling_mode(pooling) if pooling is not None else default_pooling(config)
    if modules is None:
        return PoolingPlan(mode, True, f"{mode} pooling (no modules.json: sentence-transformers' default), normalised")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    normalize = "Normalize" in kinds
    if not set(kinds) <= POOLED_HERE:
        others = sorted(set(kinds) - POOLED_HERE)
        return PoolingPlan(None, True, f"the model's own head (modules {others}), normalised"
                                       + ("" if normalize else " (modules.json has no Normalize)"))
    if "Pooling" not in kinds:
        mode = default_pooling(config)
    return PoolingPlan(mode, normalize, f"{mode} pooling, " + ("normalised" if normalize else "not normalised"))


def read_pooling_plan(folder: Path) -> PoolingPlan:
    def read(name: str) -> Any:
        path = folder / name
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    return pooling_plan(read("modules.json"), read("1_Pooling/config.json"), read("config.json") or {})


def pool(hidden: Any, mask: Any, mode: str) -> Any:
    """Rows' vectors from their tokens' last hidden states (float32), as
    sentence-transformers' Pooling computes them; `mask` 1 on real tokens."""
    h = hidden.astype(mx.float32)
    m = mask.astype(mx.float32)[..., None]
    length = h.shape[1]
    first = mx.argmax(mask, axis=1)  # the first real token (rows are padded on the right: 0)
    if mode == "cls":
        return mx.take_along_axis(h, first[:, None, None], axis=1)[:, 0]
    if mode == "lasttoken":
        last = length - 1 - mx.argmax(mask[:, ::-1], axis=1)
        return mx.take_along_axis(h * m, last[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return mx.max(mx.where(m > 0, h, -mx.inf), axis=1)
    if mode == "weightedmean":  # weights 1, 2, ... from the first real token
        m = m * (mx.arange(1, length + 1, dtype=mx.float32)[None, :, None] - first[:, None, None])
    total = mx.maximum(mx.sum(m, axis=1), 1e-9)
    return mx.sum(h * m, axis=1) / (mx.sqrt(total) if mode == "mean_sqrt_len_tokens" else total)


@dataclass(frozen=True)
class EncoderLimits:
    max_tokens: int  # the longest input, with its special tokens
    dimensions: int  # the embedding's size
    heads: int  # attention heads (the score bound)


def encoder_limits(config: dict, st_config: dict | None, model_max_length: int | None) -> EncoderLimits:
    """The limits of an encoder folder (pure): sentence-transformers'
    `max_seq_length` where it has one (what it truncates to), else the
    tokenizer's or the model's positions."""
    positions = int(config.get("max_position_embeddings") or 512)
    limit = (st_config or {}).get("max_seq_length") or model_max_length or positions
    limit = min(int(limit), positions) if config.get("model_type") == "bert" else int(limit)
    dims = int(config.get("hidden_size") or config.get("d_model") or 0)
    return EncoderLimits(limit, dims, int(config.get("num_attention_heads") or 1))


def too_long(lengths: Sequence[int], limit: int) -> EngineError | None:
    """The 400 for the first input over the model's limit (pure), or None."""
    for i, n in enumerate(lengths):
        if n > limit:
            return EngineError(400, f"input[{i}] is {n} tokens, over this embedding model's limit of {limit}; "
                                    "shorten it, split it, or send \"truncate\": true to cut it",
                               code="context_length_exceeded", param="input")
    return None


def padded(length: int) -> int:
    return -(-length // LENGTH_BUCKET) * LENGTH_BUCKET


def plan_batches(lengths: Sequence[int], heads: int, max_tokens: int, max_scores: int) -> list[list[int]]:
    """Input indices in forwards (pure): by length, longest first, as many
    rows a forward as keep its padded tokens and attention scores within
    bounds (at least one row)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches:
            rows = len(batches[-1]) + 1
            width = padded(lengths[batches[-1][0]])  # the longest of the batch: its first
            if rows * width <= max_tokens and rows * heads * width * width <= max_scores:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


def token_problem(ids: Sequence[Sequence[int]], vocab_size: int) -> EngineError | None:
    """The 400 for token ids outside the vocabulary (pure), or None."""
    for i, row in enumerate(ids):
        bad = next((t for t in row if not 0 <= t < vocab_size), None)
        if bad is not None:
            return EngineError(400, f"input[{i}] has the token id {bad}, outside this model's vocabulary "
                                    f"(0..{vocab_size - 1})", code=INVALID_REQUEST, param="input")
    return None


class Encoder:
    """One embedding model in memory: weights, tokenizer, pooling."""

    def __init__(self, model_id: str, folder: Path) -> None:
        from transformers import AutoTokenizer

        started = time.monotonic()
        self.model_id = model_id
        self.plan = read_pooling_plan(folder)
        self.model = load_embedding_model(folder)
        if self.plan.mode is None:
            from mlx_vlm.models.pooling import read_pooling_config

            self.model.pooling_config = read_pooling_config(folder)
        else:  # pooled here: the model's own (normalised) text_embeds are built lazily, never evaluated
            self.model.pooling_config = {"pooling_mode": "cls"}
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        config = json.loads((folder / "config.json").read_text())
        st_path = folder / "sentence_bert_config.json"
        st_config = json.loads(st_path.read_text()) if st_path.is_file() else None
        self.limits = encoder_limits(config, st_config, getattr(self.tokenizer, "model_max_length", None))
        self.vocab_size = int(config.get("vocab_size") or len(self.tokenizer))
        self.pad_id = self.tokenizer.pad_token_id or 0
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        self.bounds = FORWARD_BOUNDS["cpu" if on_cpu else "gpu"]
        self.streams = 1
        if on_cpu:
            from ..cpu.cpu_encoder import prepare_encoder
            from ..cpu.cpu_linear import prompt_streams, usable_cores

            prepare_encoder(self.model)  # the CPU's slow transcendental kernels replaced (engine/cpu/)
            self.streams = prompt_streams(usable_cores())
        self.load_s = time.monotonic() - started
        log.info("embedding model %s: %s", model_id, self.plan.why)

    def tokenize(self, inputs: list[str] | list[list[int]], truncate: bool) -> list[list[int]]:
        """Token ids of each input, with the model's special tokens for text;
        a 400 for an input over the limit (unless `truncate`) or a foreign id."""
        limit = self.limits.max_tokens
        if inputs and isinstance(inputs[0], str):
            ids = self.tokenizer(list(inputs), add_special_tokens=True, truncation=truncate,
                                 max_length=limit if truncate else None)["input_ids"]
        else:
            ids = [list(row) for row in inputs]  # type: ignore[arg-type]
            problem = token_problem(ids, self.vocab_size)
            if problem is not None:
                raise problem
            if truncate:
                ids = [row[:limit] for row in ids]
        refusal = too_long([len(row) for row in ids], limit)
        if refusal is not None:
            raise refusal
        return ids

    def start(self, ids: list[list[int]]) -> "EmbeddingRun":
        """A request's forwards, to be run a group at a time (EmbeddingRun.step)."""
        return EmbeddingRun(self, ids, plan_batches([len(r) for r in ids], self.limits.heads, *self.bounds))

    def _forward(self, ids: list[list[int]]) -> Any:
        """One forward's pooled vectors (lazy), its rows padded to the bucket of the longest."""
        import numpy as np

        width = padded(len(ids[0]))
        tokens = np.full((len(ids), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(ids), width), dtype=np.int32)
        for k, row in enumerate(ids):
            tokens[k, :len(row)] = row
            mask[k, :len(row)] = 1
        mask = mx.array(mask)
        out = self.model(mx.array(tokens), attention_mask=mask)
        if self.plan.mode is None or out.last_hidden_state is None:
            return out.text_embeds
        vectors = pool(out.last_hidden_state, mask, self.plan.mode)
        if self.plan.normalize:
            vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
        return vectors



def forwards_on_streams(streams: int, forwards: list[Callable[[], Any]]) -> list[Any]:
    """Each forward built on a stream of its own (one per CPU core: MLX's
    elementwise kernels use one core each) and all evaluated together."""
    from contextlib import nullcontext

    out = []
    for k, forward in enumerate(forwards):
        if streams > 1:
            from ..cpu.cpu_linear import on_stream

            context: Any = on_stream(k)
        else:
            context = nullcontext()
        with context:
            out.append(forward())
    mx.eval(*out)
    return out


class EmbeddingRun:
    """One request's forwards, a group at a time: as many forwards as the
    encoder has streams (one per core on the CPU), evaluated together. The
    engine core runs a group between two decode steps of the chat requests,
    so a long embedding request slows a running answer by a forward, not by
    its whole length."""

    def __init__(self, encoder: Encoder, ids: list[list[int]], batches: list[list[int]]) -> None:
        self.encoder, self.ids, self.batches = encoder, ids, batches
        self.tokens = sum(len(row) for row in ids)
        self._rows: list[Any] = [None] * len(ids)
        self._next = 0

    def step(self) -> bool:
        """The next group of forwards; whether the request is done."""
        import numpy as np

        enc = self.encoder
        group = self.batches[self._next:self._next + enc.streams]
        self._next += len(group)
        vectors = forwards_on_streams(enc.streams, [
            lambda batch=batch: enc._forward([self.ids[i] for i in batch]) for batch in group])
        for batch, got in zip(group, vectors):
            for row, i in zip(np.array(got.astype(mx.float32)), batch):
                self._rows[i] = row
        return self._next >= len(self.batches)

    def vectors(self) -> Any:
        import numpy as np

        return np.stack(self._rows) if self._rows else np.zeros((0, self.encoder.limits.dimensions), np.float32)
