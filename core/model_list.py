"""The configured models at a glance, one row each: where each comes from,
whether it is on disk and how big, whether it fits the memory budget (the
engine's own estimate and verdict, mlxd.models), whether the engine holds it
now, and its aliases. `mlxd models` prints the rows; the gateway's status
page (gateway/status_page.py) shows them.

`model_rows` is pure (the config's models, their estimates and the engine's
/health in; rows out); `gather_rows` reads the disk for it (no MLX).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlxd.config import Config
from mlxd.memory_estimate import read_weight_bytes
from mlxd.models import ModelInfo, embedding_dir, gguf_file, local_model_dir, model_info
from mlxd.reports import EngineHealth


@dataclass(frozen=True)
class ModelRow:
    id: str
    aliases: list[str]
    source: str  # where it comes from: the folder, repo, GGUF, Ollama name or demo
    on_disk: bool
    disk_bytes: int | None  # the files on disk (None: not there)
    estimate_bytes: int | None  # weights + KV allowance (+ its draft's), as the engine estimates
    fits: bool
    verdict: str  # the estimate's reason: why it fits, or why it is served by Ollama only
    state: str  # "loaded", "idle, unloaded", "-" (not resident), "?" (engine not reachable)
    kind: str = "chat"  # or "embedding" ([embeddings.ID]) or "reranker" ([rerankers.ID]), beside the chat model


def source_of(info: ModelInfo) -> str:
    s = info.spec
    if s.demo is not None:
        return f"demo {s.demo}"
    return s.path or s.repo or s.gguf or f"ollama {s.from_ollama}"


def model_rows(config: Config, infos: dict[str, ModelInfo], disk: dict[str, int | None],
               health: EngineHealth | None) -> list[ModelRow]:
    """One row per configured model, in the config's order (pure)."""
    aliases: dict[str, list[str]] = {}
    for alias, target in config.all_aliases.items():
        aliases.setdefault(target, []).append(alias)
    rows = []
    for model_id, info in infos.items():
        if health is None:
            state = "?"
        elif health.resident_model == model_id:
            state = "loaded"
        elif health.resident_model is None and health.unloaded_idle_model == model_id:
            state = "idle, unloaded"
        else:
            state = "-"
        rows.append(ModelRow(model_id, sorted(aliases.get(model_id, [])), source_of(info), info.on_disk,
                             disk.get(model_id), info.footprint.total_bytes, info.verdict.allowed, info.verdict.reason,
                             state))
    return rows


def embedding_rows(config: Config, weights: dict[str, int | None], disk: dict[str, int | None],
                   budget_bytes: int, health: EngineHealth | None) -> list[ModelRow]:
    """One row per embedding model (pure): its weights are its estimate, and
    every chat model's estimate carries the largest one's (mlxd.models.with_encoder)."""
    rows = []
    for model_id, spec in config.embeddings.items():
        size = weights.get(model_id)
        fits = size is None or size <= budget_bytes
        state = "?" if health is None else "loaded" if health.embedding_model == model_id else "-"
        rows.append(ModelRow(model_id, [], spec.path or spec.repo or "", disk.get(model_id) is not None,
                             disk.get(model_id), size, fits, "resident beside the chat model, counted in its estimate"
                             if fits else "its weights alone are over the memory budget", state, kind="embedding"))
    return rows


def reranker_rows(config: Config, weights: dict[str, int | None], disk: dict[str, int | None],
                  budget_bytes: int, health: EngineHealth | None) -> list[ModelRow]:
    """One row per reranker (pure): a cross-encoder's weights are its
    estimate (counted beside every chat model, as an embedding model's);
    one of embeddings or of a chat model holds none of its own."""
    rows = []
    for reranker_id, spec in config.rerankers.items():
        if spec.kind != "cross-encoder":
            uses = spec.embedding if spec.embedding is not None else config.resolve(spec.chat_model or "")
            if health is None:
                state = "?"
            else:
                resident = health.embedding_model if spec.embedding is not None else health.resident_model
                state = "loaded" if resident == uses else "-"
            rows.append(ModelRow(reranker_id, [], f"{spec.kind} {uses}", True, None, 0, True,
                                 f"ranks by {uses}'s {'vectors' if spec.embedding else 'yes/no'}: no weights of its "
                                 "own", state, kind="reranker"))
            continue
        size = weights.get(reranker_id)
        fits = size is None or size <= budget_bytes
        state = "?" if health is None else "loaded" if health.reranker_model == reranker_id else "-"
        rows.append(ModelRow(reranker_id, [], spec.path or spec.repo or "", disk.get(reranker_id) is not None,
                             disk.get(reranker_id), size, fits, "resident beside the chat model, counted in its "
                             "estimate" if fits else "its weights alone are over the memory budget", state,
                             kind="reranker"))
    return rows


def _folder_bytes(folder: Path | None) -> int | None:
    if folder is None:
        return None
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())  # a snapshot's links: their blobs


def disk_bytes(config: Config, model_id: str) -> int | None:
    """What the model's files take on disk (a GGUF's file, a folder's files, a repo's snapshot)."""
    spec = config.models[model_id]
    try:
        if spec.gguf is not None or spec.from_ollama is not None:
            path = gguf_file(spec)
            return path.stat().st_size if path is not None and path.is_file() else None
        folder = local_model_dir(config, spec)
    except Exception:  # noqa: BLE001 - an unreadable store just means "unknown"
        return None
    return _folder_bytes(folder)


def gather_rows(config: Config, budget_bytes: int, health: EngineHealth | None) -> list[ModelRow]:
    """model_rows from the disk as it is now: each model's estimate and files."""
    infos = {m: model_info(config, m, budget_bytes) for m in config.models}
    folders = {m: embedding_dir(spec) for m, spec in config.embeddings.items()}
    cross = {r: embedding_dir(spec) for r, spec in config.rerankers.items() if spec.kind == "cross-encoder"}
    return (model_rows(config, infos, {m: disk_bytes(config, m) for m in config.models}, health)
            + embedding_rows(config, _weights(folders), _disk(folders), budget_bytes, health)
            + reranker_rows(config, _weights(cross), _disk(cross), budget_bytes, health))


def _weights(folders: dict[str, Path | None]) -> dict[str, int | None]:
    """Each side model's weight bytes, as its files say (None: not on disk)."""
    return {m: (found[0] if (found := read_weight_bytes(f)) else None) if f is not None else None
            for m, f in folders.items()}


def _disk(folders: dict[str, Path | None]) -> dict[str, int | None]:
    return {m: _folder_bytes(f) for m, f in folders.items()}
