"""LiteLLM's proxy config, generated from mlxd's (never edited by hand).

Every model id and alias becomes a LiteLLM model group:
- light models: the engine (OpenAI-compatible) as the deployment, the
  model's Ollama twin (`ollama_chat/...`) as its fallback group `<name>--ollama`;
- heavy models (over the engine's memory budget): Ollama directly, the engine
  is never asked;
- with `only_light`, every alias is the light model on MLX;
- embedding models (`[embeddings]`): the engine, then their Ollama twin (`ollama/...`).
- rerankers (`[rerankers]`): the engine's /v1/rerank through LiteLLM's vLLM provider; Ollama has no rerank.
LiteLLM's defaults are wrong for a local fallback: a model on one engine gets
no retries and no cooldown, so a refused connection falls back at once and
an engine that is back gets traffic at once. A model on several engines
(`hosts`) is one group spread at random, where a failed or busy host's
request goes to every other host before Ollama. What was measured to choose
these settings: docs/DESIGN.md ("LiteLLM's settings").
No key is in this file: the gateway checks clients' itself (gateway/app.py),
and the engines' is read from $MLXD_ENGINE_KEY.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxd.config import Config

OLLAMA_SUFFIX = "--ollama"
# The engine deployments' api_key is read from this variable (set by the
# gateway from $MLXD_HOME/engine.key): no key in the file.
ENGINE_KEY_ENV = "MLXD_ENGINE_KEY"


@dataclass(frozen=True)
class Route:
    """Where one public model name goes."""

    name: str  # what clients send as `model`
    engine_model: str | None  # the name the engines get, None when Ollama serves it
    ollama_model: str | None  # the Ollama model (primary for heavy ones, else fallback)
    engine_urls: tuple[str, ...] = ()  # the engines that serve it (base URLs, no /v1)


def light_model_id(config: Config, heavy: dict[str, bool]) -> str:
    if config.gateway.light_model:
        return config.gateway.light_model
    return next((m for m in config.models if not heavy.get(m)), next(iter(config.models)))


def serving_engines(config: Config, model_id: str, heavy: dict[str, bool]) -> tuple[str, ...]:
    """The engines a model's requests go to (pure): its `hosts`, less this
    machine's engine when the model is over its memory budget (another Mac
    may hold it)."""
    urls = config.engine_urls(model_id)
    if heavy.get(model_id):
        urls = [u for u in urls if u != config.engine_url]
    return tuple(urls)


def plan_routes(config: Config, heavy: dict[str, bool]) -> list[Route]:
    """Public names -> routes (pure). `heavy` says which model ids exceed
    the local engine's memory budget (the engine's estimator decides)."""
    light = light_model_id(config, heavy)
    targets = {m: m for m in config.models} | dict(config.all_aliases)
    routes = []
    for name, model_id in targets.items():
        if config.gateway.only_light and name in config.all_aliases:
            model_id = light
        spec = config.models[model_id]
        ollama = spec.fallback_ollama or config.gateway.default_ollama_model
        engines = serving_engines(config, model_id, heavy)
        if not engines and ollama:
            routes.append(Route(name, None, ollama))
        else:  # with no engine and no Ollama, the local engine says why it cannot (model_too_large)
            routes.append(Route(name, model_id, ollama, engines or (config.engine_url,)))
    return routes


DEFAULT_OLLAMA_EMBEDDING = "all-minilm"  # Ollama's all-MiniLM-L6-v2, the default embedding model's twin


def plan_embedding_routes(config: Config) -> list[Route]:
    """Embedding model ids -> routes (pure): this machine's engine, then
    their Ollama twin."""
    return [Route(name, name, spec.ollama or DEFAULT_OLLAMA_EMBEDDING, (config.engine_url,))
            for name, spec in config.embeddings.items()]


# How often a model group on several hosts retries, by LiteLLM's error class:
# a host that is down, busy, crashing or misconfigured -> the next host; the
# client's own mistakes and the engine's deadline -> not again.
RETRIED_ON_ANOTHER_HOST = ("InternalServerErrorRetries", "RateLimitErrorRetries", "ServiceUnavailableErrorRetries",
                           "AuthenticationErrorRetries", "NotFoundErrorRetries", "DefaultRetries")
NOT_RETRIED = ("BadRequestErrorRetries", "ContentPolicyViolationErrorRetries", "TimeoutErrorRetries")
# ...and a host that fails so is left out at once (LiteLLM's names).
COOLED_DOWN_AT_FIRST_FAILURE = {"InternalServerErrorAllowedFails": 0, "RateLimitErrorAllowedFails": 0,
                                "ServiceUnavailableErrorAllowedFails": 0, "BadGatewayErrorAllowedFails": 0,
                                "AuthenticationErrorAllowedFails": 0, "NotFoundErrorAllowedFails": 0}


def retry_policy(hosts: int) -> dict[str, int]:
    """A model group's retries (pure): one per other host."""
    return {k: hosts - 1 for k in RETRIED_ON_ANOTHER_HOST} | {k: 0 for k in NOT_RETRIED}


# LiteLLM's own default depth of fallbacks (ROUTER_MAX_FALLBACKS).
LITELLM_MAX_FALLBACKS = 5


def max_fallbacks(routes: list[Route]) -> int:
    """Fallback hops a request may take (pure): one in-group failover per
    other host of the widest group, then Ollama."""
    widest = max((len(r.engine_urls) for r in routes), default=1)
    return max(LITELLM_MAX_FALLBACKS, widest)


def engine_timeout_s(config: Config) -> float:
    e = config.engine
    return e.queue_timeout_s + e.request_deadline_s + 30


def render_litellm_config(config: Config, heavy: dict[str, bool]) -> dict[str, Any]:
    """The proxy config as a dict (pure); the caller writes it as YAML."""
    timeout = engine_timeout_s(config)
    api_key = f"os.environ/{ENGINE_KEY_ENV}"  # every engine requires its key
    never_cooled = {"cooldown_time": 0}  # an engine or Ollama that is back gets traffic at once
    model_list: list[dict[str, Any]] = []
    fallbacks: list[dict[str, list[str]]] = []
    retry_policies: dict[str, dict[str, int]] = {}
    routes = plan_routes(config, heavy)
    for r in routes:
        ollama_params = {"model": f"ollama_chat/{r.ollama_model}", "api_base": config.gateway.ollama_url,
                         "timeout": timeout, "stream_timeout": timeout}
        if r.engine_model is None:
            model_list.append({"model_name": r.name, "litellm_params": ollama_params, "model_info": never_cooled})
            continue
        several = len(r.engine_urls) > 1
        for url in r.engine_urls:
            model_list.append({"model_name": r.name, "litellm_params": {
                "model": f"openai/{r.engine_model}", "api_base": url + "/v1", "api_key": api_key,
                "timeout": timeout, "stream_timeout": timeout, "max_retries": 0},
                # supports_reasoning: keeps LiteLLM from sending Anthropic clients' `thinking` to the
                # Responses API (chat/completions is the engine's own route, its Responses API a
                # translation onto it; chat answers carry reasoning_content).
                "model_info": {"supports_reasoning": False, "mlxd_engine": url}
                | ({"allowed_fails_policy": COOLED_DOWN_AT_FIRST_FAILURE} if several else never_cooled)})
        if several:
            retry_policies[r.name] = retry_policy(len(r.engine_urls))
        if r.ollama_model:
            model_list.append({"model_name": r.name + OLLAMA_SUFFIX, "litellm_params": ollama_params,
                               "model_info": never_cooled})
            fallbacks.append({r.name: [r.name + OLLAMA_SUFFIX]})
    for r in plan_embedding_routes(config):
        embedding = {"mode": "embedding"}
        model_list.append({"model_name": r.name, "litellm_params": {
            "model": f"openai/{r.engine_model}", "api_base": config.engine_url + "/v1", "api_key": api_key,
            "timeout": timeout, "max_retries": 0}, "model_info": embedding | never_cooled})
        model_list.append({"model_name": r.name + OLLAMA_SUFFIX, "litellm_params": {
            "model": f"ollama/{r.ollama_model}", "api_base": config.gateway.ollama_url, "timeout": timeout},
            "model_info": embedding | never_cooled})
        fallbacks.append({r.name: [r.name + OLLAMA_SUFFIX]})
    for name in config.rerankers:  # LiteLLM's rerank route through its vLLM provider (our /v1/rerank); no fallback
        model_list.append({"model_name": name, "litellm_params": {
            "model": f"hosted_vllm/{name}", "api_base": config.engine_url + "/v1", "api_key": api_key,
            "timeout": timeout, "max_retries": 0}, "model_info": {"mode": "rerank"} | never_cooled})
    return {
        "model_list": model_list,
        "router_settings": {
            "routing_strategy": "simple-shuffle",  # least-busy lost track of hosts (docs/DESIGN.md)
            "num_retries": 0,
            "retry_after": 0,
            "model_group_retry_policy": retry_policies,
            "fallbacks": fallbacks,
            # a failed host is left out of this request's next pick (retries alone may pick it again)
            "enable_weighted_failover": True,
            "max_fallbacks": max_fallbacks(routes),
            "cooldown_time": config.gateway.host_cooldown_s,  # a failed host of several; a busy one: Retry-After
            "timeout": timeout,
            "enable_pre_call_checks": False,
        },
        "litellm_settings": {
            "num_retries": 0,
            "request_timeout": timeout,
            "drop_params": True,
            # /v1/messages (Anthropic clients) through chat/completions, the engine's
            # own route, not the Responses API LiteLLM picks for openai/ models.
            "use_chat_completions_url_for_anthropic_messages": True,
            # The caller's hash (x-mlxd-owner, set by the gateway's key guard) reaches the engine, which files
            # stored responses under it; LiteLLM forwards a client's x- headers to these groups only.
            "model_group_settings": {"forward_client_headers_to_llm_api": [r.name for r in routes if r.engine_model]},
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
