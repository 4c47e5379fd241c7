"""`mlxd models`: every configured model at a glance (mlxd.model_list's rows:
where it comes from, whether it is on disk and how big, whether it fits the
memory budget, whether the engine holds it now, and its aliases). A table
for people, `--json` for machines.

`format_models` is pure; `main` gathers the rows and prints.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from mlxd.config import Config
from mlxd.model_list import ModelRow, gather_rows
from mlxd.reports import EngineHealth


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def format_models(rows: list[ModelRow], budget_bytes: int) -> str:
    """The table (pure)."""
    header = ["MODEL", "KIND", "ALIASES", "ON DISK", "ESTIMATE", "FITS", "ENGINE", "SOURCE"]
    cells = [[r.id, r.kind, ", ".join(r.aliases) or "-", _size(r.disk_bytes) if r.on_disk else "not yet",
              _size(r.estimate_bytes), "yes" if r.fits else "heavy: Ollama", r.state, r.source] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    line = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths)).rstrip()  # noqa: E731
    out = [line(header)] + [line(c) for c in cells]
    heavy = [r for r in rows if not r.fits]
    out.append(f"\nmemory budget for a model: {_size(budget_bytes)}"
               + "".join(f"\n  {r.id}: {r.verdict}" for r in heavy))
    return "\n".join(out)


def main(config: Config, as_json: bool) -> int:
    from mlxd.models import system_memory_budget
    from mlxd.keyfile import engine_headers
    from mlxd.probe import get_json

    budget = system_memory_budget(config.engine.memory_fraction)[0]
    status, body = get_json(config.engine_url + "/health", timeout=2.0, headers=engine_headers(config.paths.engine_key))
    health = EngineHealth.from_json(body) if status is not None and isinstance(body, dict) else None
    rows = gather_rows(config, budget, health)
    if as_json:
        print(json.dumps({"time": time.time(), "budget_bytes": budget, "models": [asdict(r) for r in rows]}, indent=2))
    else:
        print(format_models(rows, budget))
    return 0
