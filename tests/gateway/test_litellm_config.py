"""The generated LiteLLM config, as a table of mlxd configs and routes."""

from pathlib import Path

import pytest

from mlxd.config import ConfigError, engine_host_url, host_entry_problem, parse_config
from mlxd.gateway.litellm_config import (OLLAMA_SUFFIX, Route, max_fallbacks, plan_routes, render_litellm_config,
                                         retry_policy)
from mlxd.gateway.routing import FastRoutes

HOME = Path("/nonexistent")
MODELS = {"small": {"repo": "mlx-community/Qwen3-4B-4bit", "ollama": "qwen3:4b"},
          "huge": {"repo": "mlx-community/Llama-3.3-70B-Instruct-4bit", "ollama": "llama3.3:70b"},
          "plain": {"path": "/models/plain"}}
ALIASES = {"coding": "huge", "fast": "small", "default": "small", "reasoning": "plain"}
HEAVY = {"huge": True}
LOCAL = ("http://127.0.0.1:8080",)


def cfg(**gateway):
    return parse_config({"models": MODELS, "aliases": ALIASES, "gateway": gateway}, HOME)


def routes(config):
    return {r.name: r for r in plan_routes(config, HEAVY)}


def test_light_models_go_to_the_engine_with_their_ollama_twin_as_fallback():
    r = routes(cfg())
    assert r["small"] == Route("small", "small", "qwen3:4b", LOCAL)
    assert r["fast"] == Route("fast", "small", "qwen3:4b", LOCAL)
    assert r["plain"] == Route("plain", "plain", "llama3.2:3b", LOCAL)  # the default Ollama model


def test_heavy_models_go_straight_to_ollama():
    r = routes(cfg())
    assert r["coding"] == Route("coding", None, "llama3.3:70b")
    assert r["huge"] == Route("huge", None, "llama3.3:70b")


def test_only_light_maps_every_alias_to_the_light_model_on_mlx():
    r = routes(cfg(only_light=True))
    assert r["coding"] == Route("coding", "small", "qwen3:4b", LOCAL)
    assert r["huge"].engine_model is None  # a concrete name keeps its meaning


@pytest.mark.parametrize("gateway, light", [({}, "small"), ({"light_model": "plain"}, "plain")])
def test_light_model_choice(gateway, light):
    r = routes(cfg(only_light=True, **gateway))
    assert r["coding"].engine_model == light


def test_rendered_config_of_single_engines_has_no_retries_no_cooldowns_and_no_key_in_it():
    config = cfg(ollama_url="http://127.0.0.1:11434")
    out = render_litellm_config(config, HEAVY)
    groups = {m["model_name"]: m["litellm_params"] for m in out["model_list"]}
    assert groups["fast"]["model"] == "openai/small" and groups["fast"]["api_base"] == "http://127.0.0.1:8080/v1"
    assert groups["fast" + OLLAMA_SUFFIX]["model"] == "ollama_chat/qwen3:4b"
    assert groups["coding"]["model"] == "ollama_chat/llama3.3:70b" and "coding" + OLLAMA_SUFFIX not in groups
    assert {"fast": ["fast" + OLLAMA_SUFFIX]} in out["router_settings"]["fallbacks"]
    assert out["router_settings"]["num_retries"] == 0 and out["litellm_settings"]["num_retries"] == 0
    assert out["router_settings"]["model_group_retry_policy"] == {}
    assert all(m["model_info"]["cooldown_time"] == 0 for m in out["model_list"])  # back at once: no cooldown
    assert groups["fast"]["api_key"] == "os.environ/MLXD_ENGINE_KEY"  # the engine always requires its key
    assert "master_key" not in out["general_settings"] and "sk-" not in str(out)


# --- several engines per model (issue 15): LiteLLM's router balances them ----------------------------

SPREAD = {"small": {**MODELS["small"], "hosts": ["local", "studio.lan:8080", "https://laptop.lan:8443"]},
          "huge": {**MODELS["huge"], "hosts": ["local", "studio.lan:8080"]},
          "remote": {"path": "/models/remote", "hosts": ["studio.lan:8080"]}, "plain": MODELS["plain"]}


def spread(**gateway):
    return parse_config({"models": SPREAD, "aliases": ALIASES, "gateway": gateway}, HOME)


@pytest.mark.parametrize("entry, url", [
    ("local", "http://127.0.0.1:8080"),
    ("studio.lan:8080", "http://studio.lan:8080"),
    ("10.0.0.7:8081", "http://10.0.0.7:8081"),
    ("[fd00::7]:8080", "http://[fd00::7]:8080"),
    ("https://laptop.lan:8443/", "https://laptop.lan:8443"),
])
def test_a_host_entry_becomes_the_engines_base_url(entry, url):
    assert host_entry_problem(entry) is None
    assert engine_host_url(entry, "http://127.0.0.1:8080") == url


@pytest.mark.parametrize("entry", ["studio.lan", "studio.lan:http", "http://studio.lan:8080/v1", ":8080",
                                  "user@studio.lan:8080", "studio.lan:99999", "localhost"])
def test_unusable_host_entries_are_named(entry):
    assert entry in host_entry_problem(entry)
    with pytest.raises(ConfigError, match="hosts"):
        parse_config({"models": {"m": {"path": "/m", "hosts": [entry]}}}, HOME)


def test_a_host_listed_twice_or_no_host_is_refused():
    for hosts in (["local", "local"], ["a:1", "a:1"], []):
        with pytest.raises(ConfigError, match="hosts"):
            parse_config({"models": {"m": {"path": "/m", "hosts": hosts}}}, HOME)


def test_routes_list_every_host_and_leave_this_mac_out_where_the_model_is_heavy_here():
    r = {x.name: x for x in plan_routes(spread(), HEAVY)}
    assert r["fast"].engine_urls == ("http://127.0.0.1:8080", "http://studio.lan:8080", "https://laptop.lan:8443")
    assert r["coding"] == Route("coding", "huge", "llama3.3:70b", ("http://studio.lan:8080",))  # the Studio holds it
    assert r["remote"].engine_urls == ("http://studio.lan:8080",)
    assert plan_routes(spread(), {"remote": True})[0].engine_urls  # heaviness here says nothing about other Macs


def test_several_hosts_are_one_balanced_group_that_retries_on_the_next_host_before_ollama():
    config = spread(host_cooldown_s=7)
    out = render_litellm_config(config, HEAVY)
    fast = [m for m in out["model_list"] if m["model_name"] == "fast"]
    assert [m["litellm_params"]["api_base"] for m in fast] == [
        "http://127.0.0.1:8080/v1", "http://studio.lan:8080/v1", "https://laptop.lan:8443/v1"]
    assert all(m["litellm_params"]["model"] == "openai/small" for m in fast)
    # a host that fails once is left out (LiteLLM's cooldown) -- for router_settings.cooldown_time, or a 429's Retry-After
    assert all(m["model_info"]["allowed_fails_policy"]["InternalServerErrorAllowedFails"] == 0 for m in fast)
    assert all("cooldown_time" not in m["model_info"] for m in fast)
    settings = out["router_settings"]
    assert settings["routing_strategy"] == "simple-shuffle" and settings["cooldown_time"] == 7
    assert settings["model_group_retry_policy"]["fast"] == retry_policy(3)
    # ...and a host that failed this request is never its next pick, up to every host (LiteLLM#32574)
    assert settings["enable_weighted_failover"] is True and settings["max_fallbacks"] >= 3
    assert "coding" not in settings["model_group_retry_policy"]  # on one host: no other host to retry on
    assert {"fast": ["fast" + OLLAMA_SUFFIX]} in settings["fallbacks"]  # Ollama: when every host is out
    ollama = [m for m in out["model_list"] if m["model_name"] == "fast" + OLLAMA_SUFFIX]
    assert ollama[0]["model_info"]["cooldown_time"] == 0
    # every engine deployment reads the engine key from the environment: no key in the file
    assert {m["litellm_params"]["api_key"] for m in out["model_list"] if "api_key" in m["litellm_params"]} == {
        "os.environ/MLXD_ENGINE_KEY"}


@pytest.mark.parametrize("hosts, retries", [(2, 1), (3, 2)])
def test_retry_policy_gives_one_retry_per_other_host_and_none_for_client_mistakes(hosts, retries):
    policy = retry_policy(hosts)
    assert policy["InternalServerErrorRetries"] == policy["RateLimitErrorRetries"] == policy["DefaultRetries"] == retries
    assert policy["BadRequestErrorRetries"] == policy["TimeoutErrorRetries"] == 0


def test_the_fast_path_takes_only_models_on_this_macs_engine_alone():
    routes = FastRoutes.plan(spread(), HEAVY)
    assert "fast" not in routes.engine and "remote" not in routes.engine and "coding" not in routes.engine
    assert routes.engine["plain"] is None and "reasoning" in routes.engine
    assert {"fast", "fast" + OLLAMA_SUFFIX, "remote", "coding"} <= routes.known


@pytest.mark.parametrize("models", [MODELS, SPREAD])
def test_every_engine_deployment_is_sent_the_key_and_the_callers_hash(models):
    out = render_litellm_config(parse_config({"models": models}, HOME), {})
    engine_groups = {m["model_name"] for m in out["model_list"]
                     if m["litellm_params"]["model"].startswith("openai/") and "mode" not in m["model_info"]}
    assert engine_groups and all(m["litellm_params"]["api_key"] == "os.environ/MLXD_ENGINE_KEY"
                                 for m in out["model_list"] if m["model_name"] in engine_groups)
    # x-mlxd-owner (the gateway's hash of the caller's key) is forwarded to the engine's groups, none other
    forwarded = set(out["litellm_settings"]["model_group_settings"]["forward_client_headers_to_llm_api"])
    assert forwarded == engine_groups


@pytest.mark.parametrize("widths, hops", [((), 5), ((1, 1), 5), ((3, 1), 5), ((5,), 5), ((6, 2), 6), ((12,), 12)])
def test_max_fallbacks_lets_a_request_fail_over_to_every_host_then_ollama(widths, hops):
    routes = [Route(f"m{i}", "m", "llama3.2:3b", tuple(f"http://h{j}:8080" for j in range(n)))
              for i, n in enumerate(widths)]
    assert max_fallbacks(routes) == hops


@pytest.mark.parametrize("embeddings, twins", [
    ({"embedding": {"path": "/e"}}, {"embedding": "all-minilm"}),
    ({"embedding": {"path": "/e"}, "nomic": {"repo": "org/nomic", "ollama": "nomic-embed-text"}},
     {"embedding": "all-minilm", "nomic": "nomic-embed-text"}),
    ({}, {}),
])
def test_embedding_models_go_to_the_engine_then_their_ollama_twin(embeddings, twins):
    config = parse_config({"models": MODELS, "aliases": ALIASES, "embeddings": embeddings,
                           "gateway": {"ollama_url": "http://127.0.0.1:11434"}}, HOME)
    out = render_litellm_config(config, HEAVY)
    groups = {m["model_name"]: m for m in out["model_list"]}
    for name, twin in twins.items():
        assert groups[name]["litellm_params"]["model"] == f"openai/{name}"
        assert groups[name]["litellm_params"]["api_base"] == "http://127.0.0.1:8080/v1"
        assert groups[name + OLLAMA_SUFFIX]["litellm_params"] == {
            "model": f"ollama/{twin}", "api_base": "http://127.0.0.1:11434",
            "timeout": groups[name]["litellm_params"]["timeout"]}
        assert groups[name]["model_info"]["mode"] == "embedding"
        assert {name: [name + OLLAMA_SUFFIX]} in out["router_settings"]["fallbacks"]
    assert FastRoutes.plan(config, HEAVY).embedding == frozenset(twins)
