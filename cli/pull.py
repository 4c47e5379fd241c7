"""`mlxd pull` and `mlxd rm`: a Hugging Face repo into the usual hub cache
(where mlx-lm's load finds it), and out of it again.

`pull` looks before it downloads: the repo's file sizes and its config.json
(a few kB) give the engine's own memory estimate (mlxd.memory_estimate), and
a model the engine would refuse as heavy is not downloaded: the reason, and
that Ollama serves such a model, are said instead. Otherwise huggingface_hub
downloads the files mlx-lm loads (its own allow patterns) with a progress bar;
an interrupted pull resumes where it stopped. `rm` deletes every revision of
the repo from the cache and says what it freed.

A NAME is a configured model id (its `repo`), an embedding model's id
(`[embeddings.ID] repo`) or a repo id (`org/name`).

Exit codes (mlxd.exit_codes, sysexits): 64 a NAME that is none of these,
66 a repo not on the hub or not in the cache, 69 a model the engine would
refuse, 75 a transfer that failed (run it again: it resumes).
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlxd import exit_codes, memory_estimate as me
from mlxd.config import Config

# A Hugging Face repo id's parts: letters, digits, '-', '_', '.', not starting with '-' or '.', no '..' (HF's rule).
REPO_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}")


def allow_patterns() -> list[str]:
    """The files mlx-lm's load reads (its own download's allow patterns)."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return list(DEFAULT_ALLOW_PATTERNS)


@dataclass(frozen=True)
class PullPlan:
    repo: str
    files: dict[str, int]  # the files mlx-lm loads -> their sizes
    footprint: me.Footprint
    verdict: me.Verdict

    @property
    def download_bytes(self) -> int:
        return sum(self.files.values())


def repo_of(config: Config, name: str) -> str | None:
    """The repo a NAME means: a configured model's or embedding model's `repo`, or NAME itself when it is
    `org/name` (pure)."""
    if name in config.embeddings:
        return config.embeddings[name].repo
    model_id = config.resolve(name)
    if model_id is not None:
        return config.models[model_id].repo
    return name if is_repo_id(name) else None


def is_repo_id(name: str) -> bool:
    """Whether NAME is a Hugging Face repo id, `org/name` (pure): never a path (`../x`, `a/b/c`)."""
    parts = name.split("/")
    return len(parts) == 2 and all(REPO_PART.fullmatch(p) and ".." not in p for p in parts)


def plan_pull(repo: str, sizes: dict[str, int], model_config: dict | None, config: Config, model_id: str | None,
              budget_bytes: int) -> PullPlan:
    """What pulling `repo` would download and whether the engine could serve
    it, from its file sizes and config.json (pure)."""
    patterns = allow_patterns()
    files = {f: n for f, n in sizes.items() if any(fnmatch.fnmatch(f.rsplit("/", 1)[-1], p) for p in patterns)}
    weights = sum(n for f, n in files.items() if f.endswith(".safetensors"))
    e = config.engine
    bits, group, start = config.kv_settings(model_id) if model_id else (e.kv_bits, e.kv_group_size, e.quantized_kv_start)
    ctx = (config.models[model_id].context_tokens if model_id else None) or config.engine.context_tokens
    kv = me.kv_layout_for(model_config, bits, group, start)
    footprint = me.estimate_footprint(model_config, (weights, "the repo's file sizes") if weights else None, repo, ctx,
                                      kv)
    return PullPlan(repo, files, footprint, me.judge(repo, footprint, budget_bytes, config.engine.heavy_patterns))


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def pull(config: Config, name: str) -> int:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    from mlxd.models import system_memory_budget

    repo = repo_of(config, name)
    if repo is None:
        print(f"mlxd: {name!r} is neither a configured model with a `repo` nor a repo id (org/name)", file=sys.stderr)
        return exit_codes.USAGE
    model_id = config.resolve(name)
    try:
        info = HfApi().model_info(repo, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
        model_config = None
        if "config.json" in sizes:  # read aside, not into the hub cache: a refused model leaves nothing there
            with tempfile.TemporaryDirectory() as aside:
                model_config = json.loads(Path(hf_hub_download(repo, "config.json", local_dir=aside)).read_text())
    except Exception as exc:  # noqa: BLE001 - not found, offline, refused, any transport's error: said, not raised
        from huggingface_hub.errors import RepositoryNotFoundError

        if isinstance(exc, RepositoryNotFoundError):
            print(f"mlxd: {repo} is not on the Hugging Face hub (or not visible without a token)", file=sys.stderr)
            return exit_codes.NOT_FOUND
        print(f"mlxd: cannot look at {repo}: {exc}", file=sys.stderr)
        return exit_codes.TEMPFAIL
    budget = system_memory_budget(config.engine.memory_fraction)[0]
    plan = plan_pull(repo, sizes, model_config, config, model_id, budget)
    if not plan.verdict.allowed:
        table = f"embeddings.{name}" if name in config.embeddings else f"models.{model_id or 'ID'}"
        print(f"mlxd: not pulling {repo} ({_size(plan.download_bytes)}): {plan.verdict.reason}; the engine would refuse "
              f"it as heavy. Ollama serves models this size: set `ollama = \"<an Ollama model>\"` under "
              f"[{table}] and such requests go there.", file=sys.stderr)
        return exit_codes.UNAVAILABLE
    print(f"{repo}: {len(plan.files)} files, {_size(plan.download_bytes)}; {plan.verdict.reason}", flush=True)
    try:
        path = snapshot_download(repo, allow_patterns=allow_patterns())  # a progress bar; resumes a broken pull
    except Exception as exc:  # noqa: BLE001 - a broken connection, a full disk: said, and a rerun resumes
        print(f"mlxd: pulling {repo} failed: {exc} (run it again: it resumes)", file=sys.stderr)
        return exit_codes.TEMPFAIL
    print(f"{repo}: pulled into {path}")
    if model_id is None and name not in config.embeddings:
        print(f"  serve it: add [models.<id>] repo = \"{repo}\" to the config (`mlxd config path`)")
    return exit_codes.OK


def rm(config: Config, name: str) -> int:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    repo = repo_of(config, name)
    if repo is None:
        print(f"mlxd: {name!r} is neither a configured model with a `repo` nor a repo id (org/name)", file=sys.stderr)
        return exit_codes.USAGE
    try:
        cache = scan_cache_dir()
    except CacheNotFound:  # no hub cache at all on this machine: nothing pulled yet
        cache = None
    found = [r for r in cache.repos if r.repo_id == repo and r.repo_type == "model"] if cache is not None else []
    if not found:
        print(f"mlxd: {repo} is not in the Hugging Face cache", file=sys.stderr)
        return exit_codes.NOT_FOUND
    strategy = cache.delete_revisions(*(rev.commit_hash for r in found for rev in r.revisions))
    strategy.execute()
    print(f"{repo}: removed, {_size(strategy.expected_freed_size)} freed")
    return exit_codes.OK


def pull_missing(config: Config) -> list[str]:
    """`mlxd up`'s first step: every model this machine's engine serves from a
    `repo` not on disk yet, pulled now with its progress bar, instead of by
    its first request (a heavy one is refused as `pull` refuses it; one that
    cannot be fetched is said and left to its first request). The ids tried."""
    from huggingface_hub import constants

    from mlxd.config_sections import LOCAL_ENGINE
    from mlxd.models import embedding_dir, local_model_dir

    missing = [m for m, spec in config.models.items()
               if spec.repo is not None and LOCAL_ENGINE in spec.hosts and local_model_dir(config, spec) is None]
    missing += [m for m, spec in config.embeddings.items() if spec.repo is not None and embedding_dir(spec) is None]
    if missing and constants.HF_HUB_OFFLINE:
        print(f"mlxd: not on disk, and HF_HUB_OFFLINE is set: {', '.join(missing)} (Ollama answers for them)",
              file=sys.stderr)
        return []
    for model_id in missing:
        print(f"mlxd: {model_id}: {repo_of(config, model_id)} is not on disk yet; pulling it", file=sys.stderr)
        if pull(config, model_id) != exit_codes.OK:
            print(f"mlxd: {model_id} was not pulled (above); the engine fetches it at its first request",
                  file=sys.stderr)
    return missing
