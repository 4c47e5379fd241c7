"""The generated LiteLLM config, as a table of mlxd configs and routes."""

from pathlib import Path

import pytest

from mlxd.config import parse_config
from mlxd.gateway.litellm_config import OLLAMA_SUFFIX, Route, plan_routes, render_litellm_config

HOME = Path("/nonexistent")
MODELS = {"small": {"repo": "mlx-community/Qwen3-4B-4bit", "ollama": "qwen3:4b"},
          "huge": {"repo": "mlx-community/Llama-3.3-70B-Instruct-4bit", "ollama": "llama3.3:70b"},
          "plain": {"path": "/models/plain"}}
ALIASES = {"coding": "huge", "fast": "small", "default": "small", "reasoning": "plain"}
HEAVY = {"huge": True}


def cfg(**gateway):
    return parse_config({"models": MODELS, "aliases": ALIASES, "gateway": gateway}, HOME)


def routes(config):
    return {r.name: r for r in plan_routes(config, HEAVY)}


def test_light_models_go_to_the_engine_with_their_ollama_twin_as_fallback():
    r = routes(cfg())
    assert r["small"] == Route("small", "small", "qwen3:4b")
    assert r["fast"] == Route("fast", "small", "qwen3:4b")
    assert r["plain"] == Route("plain", "plain", "llama3.2:3b")  # the default Ollama model


def test_heavy_models_go_straight_to_ollama():
    r = routes(cfg())
    assert r["coding"] == Route("coding", None, "llama3.3:70b")
    assert r["huge"] == Route("huge", None, "llama3.3:70b")


def test_only_light_maps_every_alias_to_the_light_model_on_mlx():
    r = routes(cfg(only_light=True))
    assert r["coding"] == Route("coding", "small", "qwen3:4b")
    assert r["huge"].engine_model is None  # a concrete name keeps its meaning


@pytest.mark.parametrize("gateway, light", [({}, "small"), ({"light_model": "plain"}, "plain")])
def test_light_model_choice(gateway, light):
    r = routes(cfg(only_light=True, **gateway))
    assert r["coding"].engine_model == light


def test_rendered_config_has_no_retries_no_cooldowns_and_no_key():
    config = cfg(ollama_url="http://127.0.0.1:11434")
    out = render_litellm_config(config, HEAVY)
    groups = {m["model_name"]: m["litellm_params"] for m in out["model_list"]}
    assert groups["fast"]["model"] == "openai/small" and groups["fast"]["api_base"] == "http://127.0.0.1:8080/v1"
    assert groups["fast" + OLLAMA_SUFFIX]["model"] == "ollama_chat/qwen3:4b"
    assert groups["coding"]["model"] == "ollama_chat/llama3.3:70b" and "coding" + OLLAMA_SUFFIX not in groups
    assert {"fast": ["fast" + OLLAMA_SUFFIX]} in out["router_settings"]["fallbacks"]
    assert out["router_settings"]["num_retries"] == 0 and out["litellm_settings"]["num_retries"] == 0
    assert out["router_settings"]["disable_cooldowns"] is True
    assert "master_key" not in out["general_settings"] and "sk-" not in str(out)
