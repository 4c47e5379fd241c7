"""`mlxd models`: every configured model at a glance — where it comes from,
whether it is on disk and how big, whether it fits the memory budget (the
engine's own estimate and verdict, mlxd.models), whether the engine holds it
now, and its aliases. A table for people, `--json` for machines.

`model_rows` is pure (the config's models, their estimates and the engine's
/health in; rows out); `main` gathers those and prints.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mlxd.config import Config
from mlxd.models import ModelInfo, gguf_file, local_model_dir
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


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def format_models(rows: list[ModelRow], budget_bytes: int) -> str:
    """The table (pure)."""
    header = ["MODEL", "ALIASES", "ON DISK", "ESTIMATE", "FITS", "ENGINE", "SOURCE"]
    cells = [[r.id, ", ".join(r.aliases) or "-", _size(r.disk_bytes) if r.on_disk else "not yet",
              _size(r.estimate_bytes), "yes" if r.fits else "heavy: Ollama", r.state, r.source] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    line = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths)).rstrip()  # noqa: E731
    out = [line(header)] + [line(c) for c in cells]
    heavy = [r for r in rows if not r.fits]
    out.append(f"\nmemory budget for a model: {_size(budget_bytes)}"
               + "".join(f"\n  {r.id}: {r.verdict}" for r in heavy))
    return "\n".join(out)


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
    if folder is None:
        return None
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())  # a snapshot's links: their blobs


def main(config: Config, as_json: bool) -> int:
    from mlxd.models import model_info, system_memory_budget
    from mlxd.probe import get_json

    budget = system_memory_budget(config.engine.memory_fraction)[0]
    infos = {m: model_info(config, m, budget) for m in config.models}
    status, body = get_json(config.engine_url + "/health", timeout=2.0)
    health = EngineHealth.from_json(body) if status is not None and isinstance(body, dict) else None
    rows = model_rows(config, infos, {m: disk_bytes(config, m) for m in config.models}, health)
    if as_json:
        print(json.dumps({"time": time.time(), "budget_bytes": budget, "models": [asdict(r) for r in rows]}, indent=2))
    else:
        print(format_models(rows, budget))
    return 0
