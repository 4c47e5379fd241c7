"""Ollama's store, read as Ollama lays it out: names to manifests to the GGUF blob."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.config import parse_config
from mlxd.devkit.gguf_fixture import write_gguf, write_ollama_store
from mlxd.gateway.litellm_config import plan_routes
from mlxd.ollama_store import OllamaModelNotFound, manifest_parts, model_blob, models_dir


@pytest.mark.parametrize("name, parts", [
    ("qwen3:4b", ("registry.ollama.ai", "library", "qwen3", "4b")),
    ("llama3.2", ("registry.ollama.ai", "library", "llama3.2", "latest")),
    ("me/model:q4", ("registry.ollama.ai", "me", "model", "q4")),
    ("hf.co/org/repo:Q4_K_M", ("hf.co", "org", "repo", "Q4_K_M")),
])
def test_names_map_to_manifest_paths(name, parts):
    assert manifest_parts(name) == parts


@pytest.mark.parametrize("name", ["../../etc:passwd", "a/b/c/d", "x:y/z", ""])
def test_names_that_are_not_ollama_names_are_refused(name):
    with pytest.raises(OllamaModelNotFound):
        manifest_parts(name)


def test_the_models_dir_honours_ollama_models():
    assert models_dir({"OLLAMA_MODELS": "/srv/ollama"}) == Path("/srv/ollama")
    assert models_dir({}) == Path.home() / ".ollama" / "models"


@pytest.fixture(scope="module")
def store(demo_models, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ollama")
    gguf = write_gguf(demo_models.a, root / "demo-a.gguf")
    return root / "models", write_ollama_store(root / "models", "demo:tiny", gguf)


def test_the_blob_behind_a_name_is_found(store):
    models, blob = store
    assert model_blob("demo:tiny", models) == blob and blob.read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("name, says", [("demo:other", "ollama pull demo:other"), ("nope", "no model 'nope'")])
def test_a_model_ollama_does_not_have_says_how_to_get_it(store, name, says):
    with pytest.raises(OllamaModelNotFound, match=says):
        model_blob(name, store[0])


def test_from_ollama_is_also_the_fallback(tmp_path):
    config = parse_config({"models": {"q": {"from_ollama": "qwen3:4b"}}}, tmp_path)
    (route,) = [r for r in plan_routes(config, {"q": False}) if r.name == "q"]
    assert route.ollama_model == "qwen3:4b"
