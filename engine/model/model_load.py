"""Loading a model into memory: the worker's load, apart from its bookkeeping.

A text model through mlx-lm, read a chunk at a time so that every weight is
resident before the engine says ready; a vision-language model through
mlx-vlm; a rank group's shard through mlx-lm's tensor parallelism
(engine/model/ranks.py); and the resident model's KV layout (kv_bits) as this MLX
can serve it. Called on the worker thread only (every MLX call is there);
MLX is imported inside the functions, after the engine has chosen its BLAS
(engine/cpu/fast_blas.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _download, dequantize_model, load, load_tokenizer

from mlxd.memory_estimate import KVLayout
from mlxd.models import is_vision_config

from .generation import ResidentModel
from .prompt_tokens import PieceEncoder
from .tool_prompt import tool_support

log = logging.getLogger("mlxd.engine.core.worker")  # it runs on the worker thread, and logs as the worker

LOAD_CHUNK_BYTES = 256 * 2**20  # weights read (and converted) per mx.eval at load


def load_chunks(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of consecutive items grouped until a group reaches `limit`
    bytes (an item larger than `limit` is a group of its own) (pure)."""
    out: list[list[int]] = []
    group: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        group.append(i)
        total += size
        if total >= limit:
            out.append(group)
            group, total = [], 0
    if group:
        out.append(group)
    return out


def evaluate_in_chunks(params: Any, chunk_bytes: int = LOAD_CHUNK_BYTES) -> int:
    """mx.eval over a model's parameters, about `chunk_bytes` of them at a
    time (load_chunks); the number of chunks."""
    arrays = [a for _, a in tree_flatten(params)]
    groups = load_chunks([a.nbytes for a in arrays], chunk_bytes)
    for group in groups:
        mx.eval([arrays[i] for i in group])
    return len(groups)


def context_tokens(config: dict[str, Any]) -> int | None:
    """The longest sequence a model's config says it was made for (pure)."""
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def context_extension(config: dict[str, Any], extend_to: int | None) -> dict[str, Any]:
    """The config overrides that serve a model with `extend_to` tokens of
    context by YaRN RoPE scaling (pure): none where it is not asked for, not
    longer than the model's own context, or the model already scales its
    RoPE (its own scheme is what it was trained with; scaling twice is not a
    thing mlx-lm does). Without YaRN's attention temperature (mscale equal to
    mscale_all_dim): a model never tuned with it answers short prompts as it
    did unscaled only without it (the default model's "Paris" became French
    nonsense with it; docs/BENCHMARKS.md, "The default model's context")."""
    trained = context_tokens(config)
    if extend_to is None or trained is None or extend_to <= trained or config.get("rope_scaling"):
        return {}
    return {"max_position_embeddings": extend_to,
            "rope_scaling": {"type": "yarn", "factor": extend_to / trained, "original_max_position_embeddings": trained,
                             "mscale": 1.0, "mscale_all_dim": 1.0}}


def load_resident(model_id: str, target: str, weights_dtype: str | None = None,
                  extend_context: int | None = None) -> ResidentModel:
    """Loads a model folder or repo (downloading it first, as mlx-lm does):
    a vision-language model through mlx-vlm, any other through mlx-lm.
    `weights_dtype` "float32": dequantised and cast (the CPU's fast path);
    `extend_context`: its context extended by YaRN (context_extension)."""
    folder = _download(target)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if not is_vision_config(config):
        overrides = context_extension(config, extend_context)
        if overrides:
            log.info("%s: context %d tokens by YaRN RoPE scaling (%.1fx the %d it was trained on)", model_id,
                     overrides["max_position_embeddings"], overrides["rope_scaling"]["factor"],
                     overrides["rope_scaling"]["original_max_position_embeddings"])
            config = {**config, **overrides}
        # Lazily, then read a chunk at a time: every weight is resident before
        # the engine says ready (a first request that read them would take the
        # whole read into its first prefill step), and a float32 load never
        # holds the stored and the converted copy of every weight at once
        # (peak -23 % on the default model; bench/weights_load.py).
        model, tokenizer = load(str(folder), lazy=True, model_config=overrides)
        model = with_weights_plan(model_id, model, weights_dtype == "float32")
        evaluate_in_chunks(model.parameters())
        renders_tools, tool_format = tool_support(tokenizer)
        if not renders_tools:
            log.info("the chat template of %s does not render tools: mlxd writes them into the prompt", model_id)
        return ResidentModel(model_id, model, tokenizer, PieceEncoder(tokenizer), renders_tools=renders_tools,
                             tool_format=tool_format, context_tokens=context_tokens(config))
    from mlx_vlm import load as load_vlm

    model, processor = load_vlm(str(folder))
    # mlx-lm's wrapper on the same tokenizer finds the reasoning and tool-call markers.
    tokenizer = load_tokenizer(folder, eos_token_ids=getattr(model.config, "eos_token_id", None))
    # mlx-vlm's own chat template renders the prompt: tools are its to render
    renders_tools, tool_format = tool_support(tokenizer)
    return ResidentModel(model_id, model, tokenizer, None, processor, tool_format=tool_format if renders_tools else None)


def with_weights_plan(model_id: str, model: Any, whole_float32: bool) -> Any:
    """The model with its weights in the dtypes its backend runs
    (engine/cpu/backend_ops.py: decided from its modules' ops, the backend
    and the registry's float32 verdict), said in the log."""
    from ..cpu.backend_ops import backend_of, cast_modules, model_ops, weights_plan

    plan = weights_plan(backend_of(mx.default_device()), model_ops(model), whole_float32)
    if plan.whole == "float32":
        from ..cpu.cpu_decode import prepare_float32

        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        # Laid out as OpenBLAS reads it fastest, a decoded token in a quarter of the MLX ops (engine/cpu/)
        log.info("CPU weights: %s", prepare_float32(model))
    elif plan.cast_ops:
        cast = cast_modules(model, plan.cast_ops)
        log.info("weights of %s: %s (%.1f MiB of them)", model_id, plan.why, cast / 2**20)
    return model


def load_shard(model_id: str, target: str, link: Any) -> ResidentModel:
    """A rank group's load: every rank loads its shard at once (mlx-lm's
    tensor parallelism); rank 0's forward passes are mirrored over `link`."""
    from .ranks import LOAD, MirroredModel, sharded

    folder = _download(target)
    if is_vision_config(json.loads((folder / "config.json").read_text(encoding="utf-8"))):
        raise ValueError("a vision model cannot be served by a rank group")
    link.share((LOAD, model_id))
    model, tokenizer = sharded(str(folder), link)
    renders_tools, tool_format = tool_support(tokenizer)
    return ResidentModel(model_id, MirroredModel(model, link), tokenizer, PieceEncoder(tokenizer),
                         renders_tools=renders_tools, tool_format=tool_format)


def with_kv_layout(resident: ResidentModel, kv: KVLayout) -> ResidentModel:
    """The resident model with its KV layout, said in the log: which layers
    stay as they are, and whether this MLX decodes over quantised KV or over
    it dequantised (then quantised from the first position: the estimate
    counted at least that)."""
    if not kv.quantized:
        return replace(resident, kv=kv)  # (its buffers' steps: KVLayout.coarse_steps)
    from ..cache.kv_cache import quantized_decode_works, unquantised_kinds

    kept = unquantised_kinds(resident.model)
    try:
        works: bool | None = quantized_decode_works(resident.model, kv)
    except (AttributeError, TypeError, KeyError):  # args it cannot read (a text_config inside: mistral3)
        works = None
    # Multi-head latent attention (DeepSeek's MLA: a kv_lora_rank) multiplies by its cache's arrays directly.
    latent = getattr(getattr(resident.model, "args", None), "kv_lora_rank", None) is not None
    why = why_decode_dequantized(works, kept, latent)
    if why is not None:
        kv = replace(kv, quantized_start=0)
    log.info("KV cache of %s: %d-bit, groups of %d, from position %d%s%s", resident.model_id, kv.bits,
             kv.group_size, kv.quantized_start,
             f"; layers of kind {', '.join(kept)} keep the model's dtype (mlx-lm cannot quantise them)"
             if kept else "", f"; {why}, so decoding dequantises it a layer at a time" if why else "")
    return replace(resident, kv=kv, dequantized_decode=why is not None)


# Cache kinds whose to_quantized raises NotImplementedError in mlx-lm 0.32 ("RotatingKVCache Quantization NYI"):
# mlx-lm's generate_step, given kv_bits, quantises every layer that has the method, so a model with a sliding
# window (gemma3, olmo3, gpt-oss...) would fail its first request.
KINDS_MLX_LM_FAILS_TO_QUANTISE = frozenset({"RotatingKVCache", "BatchRotatingKVCache"})


def why_decode_dequantized(quantized_decode_works: bool | None, kept_kinds: list[str],
                           latent_attention: bool = False) -> str | None:
    """Why mlxd quantises the KV itself from the first position and decodes
    over it dequantised, rather than leave the quantisation to mlx-lm's
    generate_step (None: it need not) (pure). `quantized_decode_works`:
    None where the model's shape could not be probed (the safe way then)."""
    if quantized_decode_works is None:
        return "its attention over quantised KV could not be probed"
    if not quantized_decode_works:
        return "this MLX has no kernel for attention over quantised KV"
    if latent_attention:
        return "mlx-lm's latent attention (MLA) reads its KV as plain arrays"
    failing = sorted(KINDS_MLX_LM_FAILS_TO_QUANTISE.intersection(kept_kinds))
    if failing:
        return f"mlx-lm's generate_step would try to quantise its {', '.join(failing)} layers and fail"
    return None
