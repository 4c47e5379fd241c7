"""Where each configured model lives and whether it fits the engine's memory
budget, without loading MLX.

The engine refuses heavy models and the gateway routes them straight to
Ollama: both must reach the same verdict, so both ask this module. Nothing
here imports MLX at module level; only `device_memory` does, when called,
and processes that must stay MLX-free (the gateway) call
`device_memory_in_child` instead.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlxd import gguf, ollama_store
from mlxd import memory_estimate as me
from mlxd import moe_expert_bytes
from mlxd.config import Config, EmbeddingSpec, ModelSpec, RerankerSpec

log = logging.getLogger("mlxd.models")

TOTAL_ENV = "MLXD_MEMORY_TOTAL_BYTES"  # for tests and odd machines


@dataclass(frozen=True)
class ModelInfo:
    id: str
    spec: ModelSpec
    verdict: me.Verdict
    footprint: me.Footprint
    on_disk: bool  # False: a repo not downloaded yet, so the estimate may change
    prompt_cache_bytes: int = 0  # memory the prompt cache may hold beside this model
    config: dict | None = field(default=None, compare=False)  # the model's shape, for KV sizes
    weights_dtype: str | None = None  # loaded as this dtype instead of as stored (the CPU's float32)
    kv: me.KVLayout = me.KVLayout()  # how its KV cache holds values (kv_bits)
    stored_bytes: int | None = None  # its own weights as stored (no draft, no embedding model beside)


def is_vision_config(config: dict | None) -> bool | None:
    """Whether a model config describes a vision-language model (a vision
    tower beside the language model: mlx-vlm loads it); None when there is
    no config to tell."""
    if not config:
        return None
    return isinstance(config.get("vision_config"), dict)


def demo_model_dir(config: Config, variant: str) -> Path:
    return config.home / "models" / f"demo-{variant}"


def local_model_dir(config: Config, spec: ModelSpec) -> Path | None:
    """The model's folder on disk, if it is there (no download)."""
    if spec.demo is not None:
        d = demo_model_dir(config, spec.demo)
        return d if d.is_dir() else None
    if spec.path is not None:
        d = Path(spec.path).expanduser()
        return d if d.is_dir() else None
    if spec.gguf is not None or spec.from_ollama is not None:  # the header says all (model_info)
        return None
    return hub_cached_dir(spec.repo)  # type: ignore[arg-type]


def hub_cached_dir(repo: str) -> Path | None:
    """A Hugging Face repo's folder in the local hub cache, if it is there."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json")
        return Path(found).parent if isinstance(found, str) else None
    except Exception:  # noqa: BLE001 - an unusable cache just means "unknown"
        return None


def gguf_cache_dir(config: Config) -> Path:
    """Where GGUF files are converted to MLX model folders."""
    return config.home / "models" / "gguf"


def gguf_file(spec: ModelSpec) -> Path | None:
    """The GGUF a model is served from, if it is one: its own file, or the
    blob in Ollama's store (raises ollama_store.OllamaModelNotFound)."""
    if spec.gguf is not None:
        return Path(spec.gguf).expanduser()
    if spec.from_ollama is not None:
        return ollama_store.model_blob(spec.from_ollama)
    return None


def _gguf_facts(path: Path) -> tuple[dict | None, tuple[int, str] | None, bool]:
    """(model config, (weight bytes, source), on disk) from a GGUF header."""
    try:
        header = gguf.read_header(path)
        if gguf.unsupported(header) is None:
            return gguf.mlx_config(header), (gguf.weight_bytes(header), "GGUF header"), True
        return None, None, True  # the engine refuses it by name when it tries
    except (gguf.GGUFError, KeyError, TypeError, ValueError):
        return None, None, path.is_file()


def model_info(config: Config, model_id: str, budget_bytes: int, weights_dtype: str | None = None,
               experts_float32: bool = False) -> ModelInfo:
    """Footprint and verdict of a configured model id; reads config.json,
    safetensors headers or a GGUF header only. `weights_dtype` "float32":
    the engine loads it as float32 (its fast CPU path), which the weights,
    and the KV the model then computes in float32, are counted at.
    `experts_float32`: the engine runs on MLX's CPU backend, whose gather_mm
    runs float32 only, so a model loaded as stored has its float16/bfloat16
    routed experts cast to float32 (engine/cpu/backend_ops.py): counted so.
    The gateway and the CLI do not know the engine's backend and leave it
    False: where they admit a model the engine then refuses, its 400
    model_too_large falls back to Ollama as any heavy verdict does."""
    spec = config.models[model_id]
    ctx = spec.context_tokens or config.engine.context_tokens
    local = local_model_dir(config, spec)
    cfg = None
    weights = None
    on_disk = local is not None
    if spec.gguf is not None or spec.from_ollama is not None:
        try:
            cfg, weights, on_disk = _gguf_facts(gguf_file(spec))  # type: ignore[arg-type]
        except ollama_store.OllamaModelNotFound:
            on_disk = False
    elif local is not None:
        try:
            cfg = json.loads((local / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            cfg = None
        weights = me.read_weight_bytes(local)
    params = me.params_from_config(cfg) if cfg else None
    stored_bytes = weights[0] if weights is not None else None
    loaded_as = None
    if weights_dtype == "float32" and cfg and params:
        cfg, weights, loaded_as = {**cfg, "torch_dtype": "float32"}, (params * 4, "float32 on the CPU"), "float32"
    name = spec.repo or spec.path or spec.gguf or spec.from_ollama or model_id
    # Vision models (mlx-vlm's generation) keep their KV at the model's dtype.
    kv = me.KVLayout() if is_vision_config(cfg) else me.kv_layout_for(cfg, *config.kv_settings(model_id))
    footprint = me.estimate_footprint(cfg, weights, name, ctx, kv)
    # mlx-lm's loads only: mlx-vlm's (vision models) apply no weights plan, so nothing is cast there.
    if experts_float32 and loaded_as is None and local is not None and not is_vision_config(cfg):
        footprint = moe_expert_bytes.with_float32_experts(footprint, moe_expert_bytes.read_float16_expert_bytes(local))
    if spec.draft is not None:  # loaded with it: its weights and its KV for the same context count as this one's
        draft = model_info(config, spec.draft, budget_bytes, weights_dtype, experts_float32).footprint
        footprint = with_draft(footprint, draft, spec.draft)
    footprint = with_encoder(footprint, largest_encoder(config))
    footprint = with_encoder(footprint, largest_cross_encoder(config), "reranker")
    verdict = me.judge(name, footprint, budget_bytes, config.engine.heavy_patterns)
    pc = config.engine.prompt_cache
    configured = None if pc.memory_gib is None else int(pc.memory_gib * me.GIB)
    cache_bytes = me.prompt_cache_budget(budget_bytes, footprint.total_bytes, configured) if pc.enabled else 0
    return ModelInfo(model_id, spec, verdict, footprint, on_disk=on_disk, prompt_cache_bytes=cache_bytes, config=cfg,
                     weights_dtype=loaded_as, kv=kv, stored_bytes=stored_bytes)


def with_draft(footprint: me.Footprint, draft: me.Footprint, draft_id: str) -> me.Footprint:
    """A model's footprint with its draft model's added to its weights (pure):
    the draft's weights and its KV allowance are held as long as the model is
    loaded, whatever its requests hold. An unknown draft size leaves the
    model's as it is, said so."""
    if footprint.weights_bytes is None:
        return footprint
    if draft.weights_bytes is None:
        return me.Footprint(footprint.weights_bytes, footprint.kv_bytes,
                            f"{footprint.source}; draft {draft_id} not counted (size unknown)")
    return me.Footprint(footprint.weights_bytes + draft.weights_bytes + draft.kv_bytes, footprint.kv_bytes,
                        f"{footprint.source}; with draft {draft_id}")


def embedding_dir(spec: EmbeddingSpec | RerankerSpec) -> Path | None:
    """A side model's folder on disk (an embedding model's, a cross-encoder's), if it is there (no download)."""
    if spec.path is not None:
        d = Path(spec.path).expanduser()
        return d if d.is_dir() else None
    return hub_cached_dir(spec.repo)  # type: ignore[arg-type]


def largest_encoder(config: Config) -> tuple[str, int] | None:
    """(id, weight bytes) of the largest embedding model on disk: the room
    the engine keeps beside any chat model for the one resident (at most one)."""
    return _largest({name: embedding_dir(spec) for name, spec in config.embeddings.items()})


def largest_cross_encoder(config: Config) -> tuple[str, int] | None:
    """(id, weight bytes) of the largest cross-encoder reranker on disk: the
    room for the one resident beside the chat model and the embedding model
    (a reranker of embeddings or of a chat model holds no weights of its own)."""
    folders = {name: embedding_dir(spec) for name, spec in config.rerankers.items()  # type: ignore[arg-type]
               if spec.kind == "cross-encoder"}
    return _largest(folders)


def _largest(folders: dict[str, Path | None]) -> tuple[str, int] | None:
    largest: tuple[str, int] | None = None
    for name, folder in folders.items():
        found = me.read_weight_bytes(folder) if folder is not None else None
        if found is not None and (largest is None or found[0] > largest[1]):
            largest = (name, found[0])
    return largest


def with_encoder(footprint: me.Footprint, encoder: tuple[str, int] | None,
                 what: str = "embedding model") -> me.Footprint:
    """A chat model's footprint with the room of a side model resident beside
    it (an embedding model, a cross-encoder) added to its weights (pure)."""
    if footprint.weights_bytes is None or encoder is None:
        return footprint
    name, size = encoder
    return me.Footprint(footprint.weights_bytes + size, footprint.kv_bytes,
                        f"{footprint.source}; with {what} {name}")


def heavy_models(config: Config, budget_bytes: int) -> dict[str, bool]:
    """model id -> over the memory budget (the engine would refuse it)."""
    return {m: not model_info(config, m, budget_bytes).verdict.allowed for m in config.models}


METAL_SOURCE, CUDA_SOURCE = "Metal recommended working set", "CUDA device memory"


def device_memory_of(metal: bool, cuda: bool, info: dict) -> tuple[int, str] | None:
    """(bytes, what they are) of the GPU MLX runs on, from `mx.device_info()`
    (pure): Metal's recommended working set (its unified memory is the
    host's), CUDA's device memory (a card's own, not the host's RAM);
    None on the CPU."""
    if metal and info.get("max_recommended_working_set_size"):
        return int(info["max_recommended_working_set_size"]), METAL_SOURCE
    total = info.get("total_memory") or info.get("memory_size")  # the key MLX's CUDA backend uses varies
    if cuda and total:
        return int(total), CUDA_SOURCE
    return None


def device_memory() -> tuple[int, str] | None:
    """device_memory_of this machine's MLX. Imports MLX."""
    try:
        import mlx.core as mx

        metal = mx.metal.is_available()
        cuda = bool(getattr(mx, "cuda", None)) and mx.cuda.is_available()
        return device_memory_of(metal, cuda, dict(mx.device_info()) if metal or cuda else {})
    except Exception:  # noqa: BLE001 - no usable GPU: physical memory decides
        return None


def device_memory_in_child(platform: str = sys.platform) -> tuple[int, str] | None:
    """device_memory, asked of a short child process so that this one never
    loads MLX. Only where a GPU backend may be installed (Metal on macOS, an
    mlx CUDA wheel on Linux): elsewhere no child is needed."""
    if platform != "darwin" and not _cuda_wheel_installed():
        return None
    code = "import json; from mlxd.models import device_memory; print(json.dumps(device_memory()))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
        return (int(got[0]), str(got[1])) if isinstance(got, list) and len(got) == 2 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError) as exc:
        log.warning("could not ask a child process for the GPU's memory (%s); using physical memory", exc)
        return None


def _cuda_wheel_installed() -> bool:
    from importlib import metadata

    return any((d.metadata["Name"] or "").lower().startswith("mlx-cuda") for d in metadata.distributions())


def system_memory_budget(fraction: float,
                         device_total: Callable[[], tuple[int, str] | None] = device_memory) -> tuple[int, str]:
    """(budget bytes, where the total came from): $MLXD_MEMORY_TOTAL_BYTES,
    else the GPU's memory (Metal's working set, CUDA's device memory), else
    physical memory (the CPU backend)."""
    if os.environ.get(TOTAL_ENV):
        return me.memory_budget(int(os.environ[TOTAL_ENV]), fraction), TOTAL_ENV
    device = device_total()
    if device is not None:
        return me.memory_budget(device[0], fraction), device[1]
    import psutil

    return me.memory_budget(psutil.virtual_memory().total, fraction), "physical memory"
