"""`mlxd pull` and `mlxd rm` (cli/pull.py) against a Hugging Face Hub mirror
built in the test (devkit/hub_mirror.py; HF_ENDPOINT points the real
huggingface_hub client at it): a model that fits is downloaded into the hub
cache, where `mlxd models` sees it; one the engine would refuse as heavy is
refused before a byte of its weights is asked for; `rm` frees the cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.cli.pull import plan_pull, repo_of
from mlxd.config import parse_config
from mlxd.devkit.hub_mirror import serve_mirror
from mlxd.toml_text import dumps

MLXD = [sys.executable, "-m", "mlxd.cli"]
GIB = 2**30
SMALL, HEAVY, ENCODER = "acme/demo-a-mlx", "acme/Big-70B-Instruct-4bit", "acme/encoder"


@pytest.mark.parametrize("name, repo", [("demo", SMALL), ("fast", SMALL), ("org/model", "org/model"),
                                        ("local", None), ("nonsense", None), ("a/b/c", None), ("enc", ENCODER),
                                        ("enc-here", None), ("../x", None), ("org/..", None), ("org/.x", None),
                                        ("org/a..b", None), ("/x", None), ("Org_1/model-v1.5", "Org_1/model-v1.5")])
def test_what_a_name_pulls(tmp_path, name, repo):
    config = parse_config({"models": {"demo": {"repo": SMALL}, "local": {"path": "/x"}},
                           "embeddings": {"enc": {"repo": ENCODER}, "enc-here": {"path": "/e"}},
                           "aliases": {"fast": "demo"}}, tmp_path)
    assert repo_of(config, name) == repo


LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("sizes, fits", [
    ({"config.json": 700, "model-00001-of-00002.safetensors": 2 * GIB, "model-00002-of-00002.safetensors": GIB,
      "README.md": 10, "original/consolidated.pth": 9 * GIB}, True),   # 3 GiB of weights mlx-lm loads; the rest not
    ({"config.json": 700, "model.safetensors": 38 * GIB}, False),
])
def test_the_plan_counts_the_files_mlx_lm_loads_and_judges_them(tmp_path, sizes, fits):
    config = parse_config({}, tmp_path)
    plan = plan_pull("org/x", sizes, LLAMA_70B, config, None, 16 * GIB)
    assert "README.md" not in plan.files and "original/consolidated.pth" not in plan.files
    assert plan.footprint.weights_bytes == sum(n for f, n in sizes.items() if f.endswith(".safetensors"))
    assert plan.verdict.allowed is fits


@pytest.fixture
def hub(tmp_path, demo_models):
    root = tmp_path / "hub"
    shutil.copytree(demo_models.a, root / SMALL)
    shutil.copytree(demo_models.a, root / ENCODER)  # pulled, not loaded: any small folder does
    big = root / HEAVY
    big.mkdir(parents=True)
    (big / "config.json").write_text(json.dumps(LLAMA_70B))
    with open(big / "model.safetensors", "wb") as f:  # sparse: 38 GiB on the mirror's listing, nothing on disk
        f.truncate(38 * GIB)
    with serve_mirror(root) as mirror:
        yield mirror


def run(args: list[str], home: Path, mirror, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLXD_HOME": str(home), "HF_ENDPOINT": mirror.url, "HF_HUB_CACHE": str(home / "hf"),
           "HF_HUB_DISABLE_XET": "1", "MLXD_MEMORY_TOTAL_BYTES": str(32 * GIB)}
    for k in ("HF_HUB_OFFLINE", "MLXD_CONFIG", "HF_HOME"):
        env.pop(k, None)
    return subprocess.run(MLXD + args, env=env, capture_output=True, text=True, timeout=timeout)


def test_pull_models_and_rm(tmp_path, hub):
    home = tmp_path / "home"
    home.mkdir()
    (home / "mlxd.toml").write_text(dumps({"models": {"demo": {"repo": SMALL}}, "engine": {"port": 1}}))
    r = run(["models", "--json"], home, hub)
    assert json.loads(r.stdout)["models"][0]["on_disk"] is False, r.stderr
    r = run(["pull", "demo"], home, hub)
    assert r.returncode == 0, r.stderr
    assert f"{SMALL}: 7 files, 11 MiB; model '{SMALL}' needs about" in r.stdout  # said before the download
    assert f"{SMALL}: pulled into" in r.stdout, r.stdout
    snapshot = next((home / "hf" / "models--acme--demo-a-mlx" / "snapshots").iterdir())
    assert (snapshot / "model.safetensors").read_bytes() == (hub.root / SMALL / "model.safetensors").read_bytes()
    rows = json.loads(run(["models", "--json"], home, hub).stdout)["models"]
    assert rows[0]["on_disk"] and rows[0]["disk_bytes"] == sum(f.stat().st_size for f in snapshot.iterdir())
    # A model the engine would refuse: said before its weights are asked for.
    asked = len(hub.requests)
    r = run(["pull", HEAVY], home, hub)
    assert r.returncode == 69 and "heavy" in r.stderr and "Ollama" in r.stderr, r.stderr  # EX_UNAVAILABLE
    assert not any(p.endswith("model.safetensors") for p in hub.requests[asked:])
    assert not (home / "hf" / "models--acme--Big-70B-Instruct-4bit").exists()  # its config.json was read aside
    r = run(["rm", "demo"], home, hub)
    assert r.returncode == 0 and "freed" in r.stdout, r.stderr
    assert not (home / "hf" / "models--acme--demo-a-mlx").exists()
    r = run(["rm", "demo"], home, hub)  # nothing left to remove: said so (EX_NOINPUT)
    assert r.returncode == 66 and "not in the Hugging Face cache" in r.stderr, r.stderr
    r = run(["pull", "acme/missing"], home, hub)
    assert r.returncode == 66 and "not on the Hugging Face hub" in r.stderr, r.stderr
    for command in ("rm", "pull"):  # a path is not a repo id: one clear line, no traceback, EX_USAGE
        r = run([command, "../x"], home, hub)
        assert r.returncode == 64 and "Traceback" not in r.stderr and "repo id" in r.stderr, r.stderr


def test_rm_on_a_machine_with_no_hub_cache_says_so(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "MLXD_HOME": str(home), "HF_HOME": str(tmp_path / "no-hub-here"), "HF_HUB_OFFLINE": "1"}
    env.pop("MLXD_CONFIG", None)
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run([*MLXD, "rm", "acme/never-pulled"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 66 and "not in the Hugging Face cache" in r.stderr and "Traceback" not in r.stderr, \
        r.stderr


def test_up_pulls_the_configured_repos_not_on_disk_yet(tmp_path, hub):
    """`mlxd up`'s first step (cli/pull.py's pull_missing), run as up runs it: the repo this machine serves
    that is not on disk is pulled; one served by another host, and a heavy one, are not downloaded."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "mlxd.toml").write_text(dumps({"models": {
        "demo": {"repo": SMALL}, "big": {"repo": HEAVY},
        "elsewhere": {"repo": "acme/other-host-model", "hosts": ["10.0.0.9:8080"]}},
        "embeddings": {"enc": {"repo": ENCODER}}}))
    code = ("import sys; from mlxd.config import load_config, config_path; from pathlib import Path; "
            "from mlxd.cli.pull import pull_missing; home = Path(sys.argv[1]); "
            "print(pull_missing(load_config(config_path(home), home)))")
    env = {**os.environ, "MLXD_HOME": str(home), "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(home / "hf"),
           "HF_HUB_DISABLE_XET": "1", "MLXD_MEMORY_TOTAL_BYTES": str(32 * GIB)}
    for k in ("HF_HUB_OFFLINE", "MLXD_CONFIG", "HF_HOME"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", code, str(home)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "['demo', 'big', 'enc']"
    assert (home / "hf" / "models--acme--demo-a-mlx" / "snapshots").is_dir()
    assert (home / "hf" / "models--acme--encoder" / "snapshots").is_dir()  # the embedding model's repo too
    assert "heavy" in r.stderr and not any(p.endswith("model.safetensors") and "Big" in p for p in hub.requests)
    assert not any("other-host-model" in p for p in hub.requests)
    # Offline: nothing is tried, and that is said.
    r = subprocess.run([sys.executable, "-c", code, str(home)], env={**env, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "[]" and "HF_HUB_OFFLINE" in r.stderr
