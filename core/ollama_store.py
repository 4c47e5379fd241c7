"""Ollama's own model store, read-only: the GGUF behind a model name.

Ollama keeps pulled models under `$OLLAMA_MODELS` (default ~/.ollama/models):
`manifests/<registry>/<namespace>/<model>/<tag>` is a JSON manifest whose
layer of media type `application/vnd.ollama.image.model` names, by digest,
the GGUF blob in `blobs/sha256-<hex>`. So `[models.X] from_ollama =
"qwen3:4b"` serves the very weights Ollama serves as the fallback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

MODEL_LAYER = "application/vnd.ollama.image.model"
DEFAULT_REGISTRY = "registry.ollama.ai"


class OllamaModelNotFound(LookupError):
    """The name is not in Ollama's store; the message says how to get it."""


def models_dir(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def manifest_parts(name: str) -> tuple[str, ...]:
    """'qwen3:4b' -> (registry.ollama.ai, library, qwen3, 4b); 'me/m' ->
    (registry.ollama.ai, me, m, latest); 'hf.co/org/repo:q4' -> (hf.co, org,
    repo, q4) (pure)."""
    path, _, tag = name.partition(":")
    parts = path.split("/")
    if len(parts) == 1:
        parts = [DEFAULT_REGISTRY, "library", *parts]
    elif len(parts) == 2:
        parts = [DEFAULT_REGISTRY, *parts]
    if len(parts) != 3 or not all(parts) or any(p in (".", "..") for p in parts) or "/" in tag:
        raise OllamaModelNotFound(f"{name!r} is not an Ollama model name (like qwen3:4b or user/model:tag)")
    return (*parts, tag or "latest")


def model_blob(name: str, store: Path | None = None) -> Path:
    """The GGUF file Ollama serves for `name`."""
    store = store or models_dir()
    manifest = store.joinpath("manifests", *manifest_parts(name))
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
    except FileNotFoundError:
        raise OllamaModelNotFound(f"Ollama has no model {name!r} in {store} (run `ollama pull {name}`)") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise OllamaModelNotFound(f"Ollama's manifest for {name!r} is unreadable: {exc}") from None
    digest = next((layer.get("digest") for layer in layers if layer.get("mediaType") == MODEL_LAYER), None)
    if not isinstance(digest, str) or not digest.startswith("sha256:"):
        raise OllamaModelNotFound(f"Ollama's manifest for {name!r} names no model weights")
    blob = store / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise OllamaModelNotFound(f"Ollama's blob for {name!r} is missing ({blob.name}); run `ollama pull {name}`")
    return blob
