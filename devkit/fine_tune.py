"""What the tests' fine-tuned tiny models share (devkit/agent_model.py,
devkit/vision_model.py): Adam on every weight until the scripted replies
are the greedy choice at every position, and a build done once into a
folder, atomically (a stamp file marks a complete build)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from mlxd.paths import build_folder_once


def fine_tune(model: Any, loss_fn: Callable[[Any], Any], memorised: Callable[[], bool], what: str,
              say: Callable[[str], None], learning_rate: float, max_steps: int) -> int:
    """Adam steps on `loss_fn` until `memorised()` (checked every 10 steps);
    the steps taken. Raises when `max_steps` are not enough."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    optimizer = optim.Adam(learning_rate=learning_rate)
    step_fn = nn.value_and_grad(model, loss_fn)
    for step in range(1, max_steps + 1):
        loss, grads = step_fn(model)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        if step % 10 == 0:
            say(f"{what}: step {step}, loss {loss.item():.4f}")
            if memorised():
                return step
    raise RuntimeError(f"the {what} did not learn its script in {max_steps} steps")


def build_once(dest: Path, stamp_name: str, stamp: dict, build_into: Callable[[Path], None]) -> Path:
    """`build_into(folder)` unless `dest` holds a build with this stamp
    (written last, into the folder); built atomically by
    mlxd.paths.build_folder_once (a temporary sibling renamed into place,
    dead builders' leftovers removed)."""
    dest = Path(dest)
    stamp = json.loads(json.dumps(stamp))  # as it reads back (tuples become lists)

    def complete(folder: Path) -> bool:
        try:
            return json.loads((folder / stamp_name).read_text()) == stamp
        except (OSError, ValueError):
            return False

    def build_stamped(folder: Path) -> None:
        build_into(folder)
        (folder / stamp_name).write_text(json.dumps(stamp))

    build_folder_once(dest, build_stamped, complete)
    return dest


def save_weights(model: Any, folder: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
