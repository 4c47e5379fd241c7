"""Which models exist and where they live: names from the config only.

A request's `model` is looked up among configured ids and aliases and
nothing else, so `../x` or `/etc` can never reach the loader. Also answers
the heavy-model question for a model id without loading anything (it reads
config.json and safetensors headers only).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mlxd.config import Config, ModelSpec

from . import memory_estimate as me
from .errors import EngineError


@dataclass(frozen=True)
class ModelInfo:
    id: str
    spec: ModelSpec
    verdict: me.Verdict
    footprint: me.Footprint


def demo_model_dir(config: Config, variant: str) -> Path:
    return config.home / "models" / f"demo-{variant}"


def _local_dir(config: Config, spec: ModelSpec) -> Path | None:
    """The model's folder on disk, if it is there (no download)."""
    if spec.demo is not None:
        d = demo_model_dir(config, spec.demo)
        return d if d.is_dir() else None
    if spec.path is not None:
        d = Path(spec.path).expanduser()
        return d if d.is_dir() else None
    try:  # a Hugging Face repo already in the local cache
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec.repo, "config.json")
        return Path(found).parent if isinstance(found, str) else None
    except Exception:  # noqa: BLE001 - an unusable cache just means "unknown"
        return None


def system_memory_budget(fraction: float) -> tuple[int, str]:
    """(budget bytes, where the total came from). Called once at startup,
    before the worker thread exists."""
    import mlx.core as mx

    if os.environ.get("MLXD_MEMORY_TOTAL_BYTES"):  # for tests and odd machines
        return me.memory_budget(int(os.environ["MLXD_MEMORY_TOTAL_BYTES"]), fraction), "MLXD_MEMORY_TOTAL_BYTES"
    try:
        if mx.metal.is_available():
            total = int(mx.device_info()["max_recommended_working_set_size"])
            return me.memory_budget(total, fraction), "Metal recommended working set"
    except Exception:  # noqa: BLE001 - fall back to physical memory
        pass
    import psutil

    return me.memory_budget(psutil.virtual_memory().total, fraction), "physical memory"


class ModelRegistry:
    def __init__(self, config: Config, budget_bytes: int) -> None:
        self.config = config
        self.budget_bytes = budget_bytes
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
            spec = self.config.models[model_id]
            ctx = spec.context_tokens or self.config.engine.context_tokens
            local = _local_dir(self.config, spec)
            cfg = None
            weights = None
            if local is not None:
                try:
                    cfg = json.loads((local / "config.json").read_text())
                except (OSError, json.JSONDecodeError):
                    cfg = None
                weights = me.read_weight_bytes(local)
            name = spec.repo or spec.path or model_id
            fp = me.estimate_footprint(cfg, weights, name, ctx)
            verdict = me.judge(name, fp, self.budget_bytes, self.config.engine.heavy_patterns)
            info = ModelInfo(model_id, spec, verdict, fp)
            if local is None:
                return info
            self._info[model_id] = info  # same value from any thread: benign
        return self._info[model_id]

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
        model on first use."""
        spec = self.config.models[model_id]
        if spec.demo is not None:
            from .demo_model import build_demo_model

            return str(build_demo_model(demo_model_dir(self.config, spec.demo), spec.demo))
        if spec.path is not None:
            return str(Path(spec.path).expanduser())
        return spec.repo  # type: ignore[return-value]

    def listing(self) -> list[dict]:
        """GET /v1/models: every id and alias."""
        rows = [{"id": m, "object": "model", "created": 0, "owned_by": "mlxd"} for m in self.config.models]
        rows += [{"id": a, "object": "model", "created": 0, "owned_by": "mlxd", "alias_of": t}
                 for a, t in self.config.all_aliases.items()]
        return rows
