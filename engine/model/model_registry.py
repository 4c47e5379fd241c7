"""Which models exist and where they live: names from the config only.

A request's `model` is looked up among configured ids and aliases and
nothing else, so `../x` or `/etc` can never reach the loader. The
heavy-model verdict comes from mlxd.models (shared with the gateway) and is
cached here once the model is on disk.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

from mlxd.config import Config
from mlxd.memory_estimate import params_from_config
from mlxd.models import ModelInfo, demo_model_dir, gguf_cache_dir, gguf_file, is_vision_config, model_info
from mlxd.ollama_store import OllamaModelNotFound

from .errors import EngineError
from ..cpu.fast_blas import weights_dtype_on_cpu


def stored_dtype(config: dict | None) -> str | None:
    """The dtype a model's weights are stored in, by its config (None: quantised, or not said) (pure)."""
    return None if not config or "quantization" in config else config.get("torch_dtype")


class ModelRegistry:
    def __init__(self, config: Config, budget_bytes: int, cpu_float32: bool = False, on_cpu: bool = False,
                 on_cuda: bool = False, few_shapes: bool = False) -> None:
        self.config = config
        self.budget_bytes = budget_bytes
        # On the CPU with a fast BLAS, small models load as float32 (engine/cpu/fast_blas.py).
        self.cpu_float32 = cpu_float32
        # On MLX's CPU backend a model loaded as stored has its 16-bit experts cast to float32
        # (gather_mm runs nothing else: engine/cpu/backend_ops.py); its estimate counts them so.
        self.on_cpu = on_cpu
        # On MLX's CUDA backend, where cuDNN builds a graph for each attention shape it meets, prefill steps are
        # longer (prefill_pace.default_step_size) and, with `few_shapes` ([engine] attention_shapes), requests' KV
        # buffers come in coarse steps (memory_estimate.kv_allocated_tokens) and joining chunks in whole steps.
        self.on_cuda = on_cuda
        self.few_shapes = few_shapes
        # Models a backend limit was met on (engine/model/errors.py, backend_limit): float32 from then on,
        # whatever the heuristic says, for this process's life.
        self.float32_after_limit: set[str] = set()
        self._info: dict[str, ModelInfo] = {}

    def resolve(self, name: str) -> str:
        """Alias or id -> model id, or a 404 in OpenAI's shape."""
        model_id = self.config.resolve(name)
        if model_id is None:
            shown = name if len(name) <= 80 else name[:77] + "..."
            raise EngineError(404, f"The model {shown!r} does not exist; see GET /v1/models",
                              code="model_not_found", param="model")
        return model_id

    def info(self, model_id: str, *, refresh: bool = False) -> ModelInfo:
        """Footprint and verdict. Cached once the model is on disk; a model not
        there yet (a repo still to download) is looked at again each time."""
        if refresh or model_id not in self._info:
            info = model_info(self.config, model_id, self.budget_bytes)
            stored = stored_dtype(info.config)
            dtype = weights_dtype_on_cpu(self.cpu_float32, stored, info.stored_bytes,
                                         params_from_config(info.config) if info.config else None, self.budget_bytes)
            if model_id in self.float32_after_limit and stored != "float32":
                dtype = "float32"
            if dtype is not None or self.on_cpu:
                info = model_info(self.config, model_id, self.budget_bytes, weights_dtype=dtype,
                                  experts_float32=self.on_cpu)
            if self.few_shapes and not info.kv.coarse_steps:
                info = replace(info, kv=replace(info.kv, coarse_steps=True))
            if not info.on_disk:
                return info
            self._info[model_id] = info  # same value from any thread: benign
        return self._info[model_id]

    @property
    def journal_path(self) -> Path:
        """The crash journal, where the core notes a backend limit it survived."""
        return self.config.paths.journal

    def serve_as_float32(self, model_id: str) -> bool:
        """After a backend limit: the model's next load is float32 whole.
        False when it is float32 already (a reload would not help)."""
        info = self.info(model_id)
        if info.weights_dtype == "float32" or stored_dtype(info.config) == "float32":
            return False
        self.float32_after_limit.add(model_id)
        self._info.pop(model_id, None)
        return True

    def context_overflow(self, model_id: str) -> str:
        """What a conversation longer than this model's context gets (its own setting, else the engine's)."""
        return self.config.models[model_id].context_overflow or self.config.engine.context_overflow

    def max_concurrency(self, model_id: str) -> int:
        """Requests generated at once for this model (its own setting, else the engine's)."""
        return self.config.models[model_id].max_concurrency or self.config.engine.max_concurrency

    def most_concurrency(self) -> int:
        """The most requests any model generates at once: the worker's slots."""
        return max([self.config.engine.max_concurrency]
                   + [m.max_concurrency or 0 for m in self.config.models.values()])

    def is_vision(self, model_id: str) -> bool | None:
        """Whether the model sees images (mlx-vlm loads it); None while its
        config is not on disk yet."""
        spec = self.config.models[model_id]
        if spec.demo is not None:
            return spec.demo == "vision"
        return is_vision_config(self.info(model_id).config)

    def check_allowed(self, model_id: str) -> None:
        """Raise the `model_too_large` refusal for a heavy model."""
        verdict = self.info(model_id).verdict
        if not verdict.allowed:
            # 400, not 422: LiteLLM 1.106's proxy answers a primary's 422 with a 200 "null"
            # instead of falling back; a 400 falls back to Ollama as it should.
            raise EngineError(400, f"{verdict.reason}; refused to protect the engine from running out of memory",
                              code="model_too_large", param="model")

    def load_target(self, model_id: str) -> str:
        """What mlx-lm's load() gets: a folder or a repo id. Builds the demo
        model, or converts a GGUF, on first use (on the worker thread)."""
        spec = self.config.models[model_id]
        if spec.demo is not None:
            from .demo_model import build_demo_model

            return str(build_demo_model(demo_model_dir(self.config, spec.demo), spec.demo))
        if spec.path is not None:
            return str(Path(spec.path).expanduser())
        if spec.gguf is not None or spec.from_ollama is not None:
            from .gguf_convert import convert_gguf

            try:
                path = gguf_file(spec)
            except OllamaModelNotFound as exc:
                raise EngineError(503, str(exc), code="model_load_failed", param="model") from None
            return str(convert_gguf(path, gguf_cache_dir(self.config)))  # type: ignore[arg-type]
        return spec.repo  # type: ignore[return-value]

    def embedding_folder(self, model_id: str) -> Path:
        """An embedding model's folder: its path, or its repo from the hub
        cache (downloaded once; an EngineError 503 where it cannot be)."""
        spec = self.config.embeddings[model_id]
        return side_model_folder("embedding model", model_id, spec.path, spec.repo)

    def reranker_folder(self, reranker_id: str) -> Path:
        """A cross-encoder reranker's folder, as an embedding model's."""
        spec = self.config.rerankers[reranker_id]
        return side_model_folder("reranker", reranker_id, spec.path, spec.repo)

    def build_key(self, model_id: str, target: str) -> str:
        """`id@fingerprint` of the files `target` loads and the dtype they
        load in and the layout of their KV: prompt-cache entries never cross
        models, nor builds of one model (weights replaced under the same id),
        nor its float32 load, nor another kv_bits."""
        folder = Path(target)
        if not folder.is_dir():
            try:
                from huggingface_hub import snapshot_download

                folder = Path(snapshot_download(target, local_files_only=True))
            except Exception:  # noqa: BLE001 - not downloaded / not a repo: the name is all we know
                return f"{model_id}@{hashlib.sha256(target.encode()).hexdigest()[:16]}"
        h = hashlib.sha256(str(folder.resolve()).encode())
        info = self.info(model_id)
        if info.weights_dtype is not None:
            h.update(f"as {info.weights_dtype};".encode())
        if info.kv.quantized:
            h.update(f"{info.kv.key};".encode())
        for f in sorted(folder.iterdir()):
            if f.is_file():
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        return f"{model_id}@{h.hexdigest()[:16]}"

    def listing(self) -> list[dict]:
        """GET /v1/models: every id and alias."""
        rows = [{"id": m, "object": "model", "created": 0, "owned_by": "mlxd"} for m in self.config.models]
        rows += [{"id": a, "object": "model", "created": 0, "owned_by": "mlxd", "alias_of": t}
                 for a, t in self.config.all_aliases.items()]
        return rows


def side_model_folder(kind: str, model_id: str, path: str | None, repo: str | None) -> Path:
    """A side model's folder (an embedding model, a cross-encoder): its path,
    or its repo from the hub cache (downloaded once; an EngineError 503 where
    it cannot be)."""
    if path is not None:
        return Path(path).expanduser()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                            "1_Pooling/*"]))
    except Exception as exc:  # noqa: BLE001 - offline, no such repo: the gateway falls back
        raise EngineError(503, f"could not fetch {kind} {model_id!r} ({repo}): {exc}",
                          code="model_load_failed", param="model", retry_after=30) from None
