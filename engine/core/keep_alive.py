"""How long the resident model stays loaded with nothing to do (pure).

mlxd runs all day on a laptop whose memory its user also needs: after
`[engine] keep_alive` without a request the model, its KV and MLX's buffer
cache are given back (the engine core's `idle`), and the next request loads
it again; the prompt cache's disk tier keeps the conversations warm across.
A request may set it for after itself, as Ollama's API has it: `keep_alive`
0 unloads once it is answered, a negative one never. Durations are written
as Ollama (Go) writes them: "5m", "1h30m", "90s", "500ms", or a number of
seconds.
"""

from __future__ import annotations

from mlxd.durations import NEVER, describe  # noqa: F401 - the engine core's names for them


def unload_deadline(ended_at: float, keep_alive_s: float) -> float:
    """When a model left idle at `ended_at` is given back (NEVER, infinite, stays NEVER)."""
    return ended_at + keep_alive_s


def unload_due(now: float, deadline: float, resident: bool, busy: bool) -> bool:
    """Whether to unload now: a model resident, nothing running or waiting, its deadline passed."""
    return resident and not busy and now >= deadline
