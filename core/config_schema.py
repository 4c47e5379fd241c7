"""The whole config document (pydantic): its sections (mlxd.config_sections),
the models and aliases, and the checks that span them. Pure: reading the
file and the environment is mlxd.config_loading's."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, model_validator

from mlxd import default_embedding, default_model
from mlxd.config_engine import EngineConfig
from mlxd.config_sections import (LOCAL_ENGINE, EmbeddingSpec, GatewayConfig, ModelSpec, RerankerSpec, Strict,
                                  SupervisorConfig, engine_host_url)
from mlxd.paths import StatePaths

REQUIRED_ALIASES = ("fast", "default", "coding", "reasoning")
DEMO_MODEL_ID = "demo"
# A model id is a plain name: never a path, so a request cannot point the
# engine at arbitrary files (ids are looked up in the config, nothing else).
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$"


def default_models(real_gguf: Path) -> dict[str, ModelSpec]:
    """With no model configured: the real default model once set-up fetched
    it (mlxd.default_model), else the random-weight demo model."""
    if real_gguf.is_file():
        return {default_model.MODEL_ID: ModelSpec(gguf=str(real_gguf), ollama=default_model.OLLAMA_TWIN,
                                                  extend_context=default_model.CONTEXT_TOKENS)}
    return {DEMO_MODEL_ID: ModelSpec(demo="a")}


def default_embeddings(folder: Path) -> dict[str, EmbeddingSpec]:
    """With no embedding model configured: the default one once set-up
    fetched it (mlxd.default_embedding), else none (Ollama's twin answers)."""
    if (folder / "model.safetensors").is_file():
        return {default_embedding.MODEL_ID: EmbeddingSpec(path=str(folder), ollama=default_embedding.OLLAMA_TWIN)}
    return {}


DEFAULT_RERANKER_ID = "reranker"


def default_rerankers(embeddings: list[str]) -> dict[str, RerankerSpec]:
    """With no reranker configured: `reranker`, the first embedding model's
    vectors (the default one, all-MiniLM-L6-v2: no cross-encoder is published
    on the package registry), else none."""
    if DEFAULT_RERANKER_ID in embeddings or not embeddings:
        return {}
    return {DEFAULT_RERANKER_ID: RerankerSpec(embedding=embeddings[0])}


def connect_host(bind_host: str) -> str:
    """The address a local client uses for a server bound to `bind_host`:
    a wildcard bind ("0.0.0.0", "::", "") is reached over IPv4 loopback; an
    IPv6 literal is bracketed; anything else is used as it is."""
    if bind_host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


class Config(Strict):
    """mlxd's configuration: the file's sections, models and aliases, plus the state directory."""

    home: Path = Field(description="The state directory ($MLXD_HOME); never a setting in the file.")
    engine: EngineConfig = EngineConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    gateway: GatewayConfig = GatewayConfig()
    models: dict[str, ModelSpec] = Field(
        default_factory=lambda: default_models(default_model.gguf_path()), description=(
            "The MLX models by id (`[models.ID]`). None configured: the default model, SmolLM2-135M-Instruct, or "
            "the built-in demo model when set-up could not fetch it."))
    embeddings: dict[str, EmbeddingSpec] = Field(
        default_factory=lambda: default_embeddings(default_embedding.folder()), description=(
            "The embedding models by id (`[embeddings.ID]`), for `/v1/embeddings`. None configured: `embedding`, "
            "all-MiniLM-L6-v2, once set-up fetched it."))
    rerankers: dict[str, RerankerSpec] = Field(default_factory=dict, description=(
        "The rerankers by id (`[rerankers.ID]`), for `/v1/rerank`. None configured: `reranker`, the cosine of the "
        "first embedding model's vectors (all-MiniLM-L6-v2 by default)."))
    aliases: dict[str, str] = Field(default_factory=dict, description=(
        "`alias = \"model id\"`. `fast`, `default`, `coding` and `reasoning` always exist; unset ones point at the "
        "first model under [models] (the default model, SmolLM2-135M-Instruct or the built-in demo model, when "
        "there is none)."))

    @model_validator(mode="before")
    @classmethod
    def _default_rerankers(cls, data: object) -> object:
        """No `[rerankers]` in the file: the default follows the embedding models."""
        if isinstance(data, dict) and "rerankers" not in data:
            embeddings = data.get("embeddings")
            names = list(embeddings) if isinstance(embeddings, dict) else \
                list(default_embeddings(default_embedding.folder()))
            data = {**data, "rerankers": default_rerankers(names)}
        return data

    @model_validator(mode="after")
    def _check_names(self) -> "Config":
        for name in self.embeddings:
            if name in self.models or name in self.all_aliases:
                raise ValueError(f"embeddings.{name} is also a model id or alias; pick one")
        for name, spec in self.rerankers.items():
            if name in self.models or name in self.all_aliases or name in self.embeddings:
                raise ValueError(f"rerankers.{name} is also a model id, alias or embedding model; pick one")
            if spec.embedding is not None and spec.embedding not in self.embeddings:
                raise ValueError(f"rerankers.{name}: embedding {spec.embedding!r} is not under [embeddings]")
            if spec.chat_model is not None and self.resolve(spec.chat_model) is None:
                raise ValueError(f"rerankers.{name}: chat_model {spec.chat_model!r} is not a model id or alias")
        for name in list(self.models) + list(self.aliases) + list(self.embeddings) + list(self.rerankers):
            if not re.match(MODEL_ID_PATTERN, name):
                raise ValueError(f"model/alias name {name!r} must match {MODEL_ID_PATTERN}")
        if self.gateway.light_model is not None and self.gateway.light_model not in self.models:
            raise ValueError(f"gateway.light_model {self.gateway.light_model!r} is not under [models]")
        for alias, target in self.aliases.items():
            if target not in self.models:
                raise ValueError(f"aliases.{alias} points at {target!r}, which is not under [models]")
            if alias in self.models:
                raise ValueError(f"aliases.{alias} is also a model id; pick one")
        for name, spec in self.models.items():
            bits = spec.kv_bits or self.engine.kv_bits
            if spec.draft is not None:
                draft = self.models.get(spec.draft)
                if draft is None:
                    raise ValueError(f"model {name!r}: draft {spec.draft!r} is not under [models]")
                if spec.draft == name or draft.draft is not None:
                    raise ValueError(f"model {name!r}: its draft {spec.draft!r} must be another model without a "
                                     "draft of its own")
                if draft.demo == "vision" or spec.demo == "vision":
                    raise ValueError(f"model {name!r}: a vision model neither has nor is a draft")
            if bits < 16 and self.engine.ranks.enabled:
                raise ValueError(f"model {name!r}: kv_bits = {bits} is not supported in a rank group "
                                 "([engine.ranks]): each rank keeps its own KV cache at the model's dtype")
        return self

    def speculative_for(self, model_id: str) -> str:
        """A model's speculative decoding: its own setting, else the engine's;
        "draft" where it has a draft model and speculation is not off."""
        spec = self.models[model_id]
        mode = spec.speculative or self.engine.speculative
        return "draft" if mode != "off" and spec.draft is not None else mode

    def kv_settings(self, model_id: str) -> tuple[int, int, int]:
        """(kv_bits, kv_group_size, quantized_kv_start) of a model: its own, else the engine's."""
        spec, engine = self.models[model_id], self.engine
        return (spec.kv_bits or engine.kv_bits, spec.kv_group_size or engine.kv_group_size,
                engine.quantized_kv_start if spec.quantized_kv_start is None else spec.quantized_kv_start)

    @property
    def all_aliases(self) -> dict[str, str]:
        """Configured aliases plus the required ones, which default to the
        first configured model (the default model when none is configured)."""
        first = next(iter(self.models))
        merged = {a: first for a in REQUIRED_ALIASES}
        merged.update(self.aliases)
        return merged

    def resolve(self, name: str) -> str | None:
        """Alias or model id -> model id; None when unknown."""
        if name in self.models:
            return name
        return self.all_aliases.get(name)

    @property
    def paths(self) -> StatePaths:
        """Every file and folder under the state directory."""
        return StatePaths(self.home)

    @property
    def engine_url(self) -> str:
        """Where this machine reaches the engine, e.g. http://127.0.0.1:8080
        (no trailing slash; add /health or /v1)."""
        return f"http://{connect_host(self.engine.host)}:{self.engine.port}"

    def engine_urls(self, model_id: str) -> list[str]:
        """The base URLs of the engines that serve a model, in config order."""
        return [engine_host_url(h, self.engine_url) for h in self.models[model_id].hosts]

    @property
    def remote_engines(self) -> bool:
        """Whether any model is served by an engine on another host."""
        return any(h != LOCAL_ENGINE for spec in self.models.values() for h in spec.hosts)

    @property
    def gateway_url(self) -> str:
        """Where this machine reaches the gateway (add /v1 for clients)."""
        return f"http://{connect_host(self.gateway.host)}:{self.gateway.port}"
