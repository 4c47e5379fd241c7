"""A rank group: one engine whose model is sharded over several processes
(one per Mac, or several on one Mac for testing), launched together by
MLX's own `mlx.launch` (ring backend over TCP, or JACCL over Thunderbolt).

Rank 0 is the engine as always: HTTP, admission, the worker. Its model is a
`MirroredModel`: before every forward pass it tells the other ranks (over
mx.distributed, the group mlx.launch set up) what to run, so all ranks run
the same forward passes in the same order, and the collectives inside a
sharded model (mlx-lm's tensor parallelism, `model.shard`) meet. The other
ranks run `follow`: no HTTP, only what rank 0 says. This mirrors the forward
pass, not the generation, so every way the worker generates (sampling,
stop strings, cancels, deadlines) works unchanged, and a rank never runs a
step rank 0 did not.

Messages go over `all_sum` (the one collective every backend has), as
mlx_lm.server's distributed mode does: rank 0 contributes the bytes, the
others zeros. They run on mlx-lm's generation stream, so they stay in order
with the forward passes' own collectives.
"""

from __future__ import annotations

import gc
import logging
import pickle
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import sharded_load

log = logging.getLogger("mlxd.engine.model.ranks")

LOAD, UNLOAD, BEGIN, FORWARD, END, STOP = "load", "unload", "begin", "forward", "end", "stop"


class RankLink:
    """Rank 0 says, the others hear: every call is a collective that all
    ranks make in the same order."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def share(self, message: Any = None) -> Any:
        """Rank 0's `message` (any picklable value), on every rank."""
        with mx.stream(generation_stream):
            if self.rank == 0:
                data = mx.array(list(pickle.dumps(message)), dtype=mx.uint8)
                mx.eval(mx.distributed.all_sum(mx.array(data.size), group=self.group))
                mx.eval(mx.distributed.all_sum(data, group=self.group))
                return message
            size = mx.distributed.all_sum(mx.array(0), group=self.group).item()
            data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=self.group)
            return pickle.loads(bytes(data.tolist()))

    def tensor(self, value: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """Rank 0's array on every rank (lazily: no sync of its own)."""
        mine = value if self.rank == 0 else mx.zeros(shape, dtype=dtype)
        return mx.distributed.all_sum(mine, group=self.group)


class MirroredModel:
    """Rank 0's model: each forward pass is announced, then run by every rank.
    Everything else (layers, make_cache, args) is the model's own."""

    def __init__(self, model: Any, link: RankLink) -> None:
        self.model = model
        self.link = link

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        if kwargs:  # input embeddings (vision models) are not mirrored
            raise ValueError(f"a rank group cannot run a forward pass with {sorted(kwargs)}")
        self.link.share((FORWARD, tuple(inputs.shape), str(inputs.dtype)))
        return run_forward(self.model, self.link.tensor(inputs, inputs.shape, inputs.dtype), cache)


def run_forward(model: Any, inputs: Any, cache: Any) -> Any:
    """One forward pass, evaluated the same way on every rank: through the
    last position's logits, so every collective in it runs on every rank
    (mlx-lm's prefill evaluates only the KV cache, which would leave the last
    layer's collectives to the ranks that evaluate logits: a deadlock)."""
    out = model(inputs, cache=cache)
    mx.eval(out[:, -1, :])
    return out


def dtype_named(name: str) -> Any:
    return getattr(mx, name.removeprefix("mlx.core."))


def sharded(target: str, link: RankLink) -> tuple[Any, Any]:
    """mlx-lm's tensor-parallel load of this rank's shard (every rank at once)."""
    return sharded_load(target, tensor_group=link.group)


def follow(link: RankLink, load: Callable[[str], Any] | None = None, model: Any = None) -> None:
    """Ranks above 0: do what rank 0 says until it says stop (`model`: one
    already loaded)."""
    load = load or (lambda target: sharded(target, link)[0])
    cache = None
    while True:
        message = link.share()
        kind = message[0]
        if kind == LOAD:
            model = cache = None
            gc.collect()
            log.info("rank %d: loading %s", link.rank, message[1])
            model = load(message[1])
        elif kind == UNLOAD:
            model = cache = None
            gc.collect()
            mx.clear_cache()
        elif kind == BEGIN:
            cache = make_prompt_cache(model)
        elif kind == FORWARD:
            _, shape, dtype = message
            with mx.stream(generation_stream):
                run_forward(model, link.tensor(None, shape, dtype_named(dtype)), cache)
        elif kind == END:
            cache = None
        elif kind == STOP:
            return
