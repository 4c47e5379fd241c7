"""LiteLLM's proxy config, generated from mlxd's (never edited by hand).

Every model id and alias becomes a LiteLLM model group:
- light models: the engine (OpenAI-compatible) as the deployment, the
  model's Ollama twin (`ollama_chat/...`) as its fallback group `<name>--ollama`;
- heavy models (over the engine's memory budget): Ollama directly, the engine
  is never asked;
- with `only_light`, every alias is the light model on MLX.
LiteLLM's defaults are wrong for a local fallback (checked on 1.106.2):
retries turn a refused connection into ~5 s before the fallback answers, and
cooldowns keep traffic away from an engine that is already back. So: no
retries, no cooldowns, long timeouts (the engine has its own deadline).
The key is not in this file: the gateway checks it itself (gateway/app.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxd.config import Config

OLLAMA_SUFFIX = "--ollama"
# With engine.require_key the engine deployments' api_key is read from this
# variable (set by the gateway from $MLXD_HOME/engine.key): no key in the file.
ENGINE_KEY_ENV = "MLXD_ENGINE_KEY"


@dataclass(frozen=True)
class Route:
    """Where one public model name goes."""

    name: str  # what clients send as `model`
    engine_model: str | None  # the name the engine gets, None for heavy models
    ollama_model: str | None  # the Ollama model (primary for heavy ones, else fallback)


def light_model_id(config: Config, heavy: dict[str, bool]) -> str:
    if config.gateway.light_model:
        return config.gateway.light_model
    return next((m for m in config.models if not heavy.get(m)), next(iter(config.models)))


def plan_routes(config: Config, heavy: dict[str, bool]) -> list[Route]:
    """Public names -> routes (pure). `heavy` says which model ids exceed
    the engine's memory budget (the engine's estimator decides)."""
    light = light_model_id(config, heavy)
    targets = {m: m for m in config.models} | dict(config.all_aliases)
    routes = []
    for name, model_id in targets.items():
        if config.gateway.only_light and name in config.all_aliases:
            model_id = light
        spec = config.models[model_id]
        ollama = spec.fallback_ollama or config.gateway.default_ollama_model
        if heavy.get(model_id) and ollama:
            routes.append(Route(name, None, ollama))
        else:
            routes.append(Route(name, model_id, ollama))
    return routes


def engine_timeout_s(config: Config) -> float:
    e = config.engine
    return e.queue_timeout_s + e.request_deadline_s + 30


def render_litellm_config(config: Config, heavy: dict[str, bool]) -> dict[str, Any]:
    """The proxy config as a dict (pure); the caller writes it as YAML."""
    engine_base = config.engine_url + "/v1"
    timeout = engine_timeout_s(config)
    model_list: list[dict[str, Any]] = []
    fallbacks: list[dict[str, list[str]]] = []
    for r in plan_routes(config, heavy):
        ollama_params = {"model": f"ollama_chat/{r.ollama_model}", "api_base": config.gateway.ollama_url,
                         "timeout": timeout, "stream_timeout": timeout}
        if r.engine_model is None:
            model_list.append({"model_name": r.name, "litellm_params": ollama_params})
            continue
        model_list.append({"model_name": r.name, "litellm_params": {
            "model": f"openai/{r.engine_model}", "api_base": engine_base,
            "api_key": f"os.environ/{ENGINE_KEY_ENV}" if config.engine.require_key else "mlxd-engine-loopback",
            "timeout": timeout, "stream_timeout": timeout, "max_retries": 0},
            # Keeps LiteLLM from sending Anthropic clients' `thinking` to the Responses
            # API (the engine serves chat/completions; its answers carry reasoning_content).
            "model_info": {"supports_reasoning": False}})
        if r.ollama_model:
            model_list.append({"model_name": r.name + OLLAMA_SUFFIX, "litellm_params": ollama_params})
            fallbacks.append({r.name: [r.name + OLLAMA_SUFFIX]})
    return {
        "model_list": model_list,
        "router_settings": {
            "num_retries": 0,
            "retry_after": 0,
            "fallbacks": fallbacks,
            "disable_cooldowns": True,  # an engine that is back gets traffic at once
            "timeout": timeout,
            "enable_pre_call_checks": False,
        },
        "litellm_settings": {
            "num_retries": 0,
            "request_timeout": timeout,
            "drop_params": True,
            # /v1/messages (Anthropic clients) through chat/completions, which the
            # engine serves, not the Responses API LiteLLM picks for openai/ models.
            "use_chat_completions_url_for_anthropic_messages": True,
            "telemetry": False,
            "turn_off_message_logging": True,
            "callbacks": [],
            "success_callback": [],
            "failure_callback": [],
        },
        "general_settings": {
            "disable_spend_logs": True,
            "disable_error_logs": True,
            "background_health_checks": False,
            "store_model_in_db": False,
        },
    }
