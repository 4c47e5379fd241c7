"""The CPU's float32 path, second half: Linear and Embedding layers keep
their weight transposed where OpenBLAS reads it faster so.

A decoded token reads every weight once through a matrix-vector product, so
memory bandwidth sets the decode speed, and the layout decides how fast
OpenBLAS reads (docs/BENCHMARKS.md, "The CPU path's layouts"):
- **Transposed where a layer widens.** MLX's `Linear` computes `x @ W.T`;
  through sgemv (engine/cpu/fast_blas.py's shim) `x @ W` reads faster on a
  layer at least as wide as its inputs (the MLP's gate and up projections,
  the output head), `x @ W.T` on one that narrows (the down projection): a
  widening layer is held transposed (TransposedLinear), a narrowing one as
  stored (StoredLinear). A tied output head (`embed_tokens.as_linear`) is
  the same product, so the embedding is held transposed too, its lookup
  reading a column per token (no second copy).
- **Query, key and value as one product** (SharedInputProduct): the narrow
  key and value projections read slowly alone.
- **A prompt's rows on two streams.** A prompt's products compute rather
  than read (sgemm, one OpenBLAS thread: the engine keeps OpenBLAS's own
  threads at half the cores, since they spin on busy cores), so the rows of
  a prompt (64 or more) are cut over two MLX CPU streams; a token's product
  stays on one (one core's sgemv reads what memory gives).
Only the float32 CPU path uses it (engine/cpu/cpu_decode.py's
prepare_float32, called by engine/model/model_load.py load_resident): on
Metal and CUDA, and for quantised weights, MLX's own kernels read `W` as
stored.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

# MLX at import: engine/model/model_load.py imports this module inside its load,
# after the engine has chosen MLX's BLAS (tests/engine/test_import_order.py).
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

MAX_PROMPT_STREAMS = 2  # one stream per core of a 2-core machine
PROMPT_SPLIT_MIN_ROWS = 64  # fewer rows (a token, a batch's decode step) read memory: one stream


def prompt_streams(cores: int) -> int:
    """The streams a prompt's rows are cut over, for the cores this process
    may use (pure): one per core, at most MAX_PROMPT_STREAMS."""
    return min(MAX_PROMPT_STREAMS, max(1, cores))


def transposes(inputs: int, outputs: int) -> bool:
    """Whether a Linear layer is held transposed (pure): a layer at least as
    wide as its inputs; through sgemv a narrowing one (an MLP's down
    projection) reads faster as stored (bench/one_row_products.py)."""
    return outputs >= inputs


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity call
        return os.cpu_count() or 1


_streams: list[Any] = []


def cpu_stream(i: int) -> Any:
    """The CPU stream part `i` of a prompt's rows runs on: the first on the
    caller's (None: the generation stream), the others on streams of their
    own, made once."""
    if i == 0:
        return None
    while len(_streams) < i:
        _streams.append(mx.new_stream(mx.cpu))
    return _streams[i - 1]


def on_stream(i: int) -> Any:
    """`with on_stream(i):` the ops built inside run on stream i (cpu_stream)."""
    stream = cpu_stream(i)
    return mx.stream(stream) if stream is not None else nullcontext()


def _by_prompt_rows(x: Any, product: Any, streams: int) -> Any:
    """product(x), a prompt's rows cut into `streams` parts each on its own
    stream: a token's one-row product reads memory, which one core nearly
    fills, but a prompt's computes, and one core computes half what two do."""
    rows = x.shape[-2] if x.ndim >= 2 else 1
    if streams < 2 or rows < PROMPT_SPLIT_MIN_ROWS:
        return product(x)
    bounds = [rows * i // streams for i in range(streams + 1)]
    outs = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        with on_stream(i):
            outs.append(product(x[..., a:b, :]))
    return mx.concatenate(outs, axis=-2)


def transposed_product(x: Any, weight_t: Any) -> Any:
    """x @ W.T for `weight_t` = W.T, held as 1 x inputs x outputs: for one
    sequence (x: 1 x L x inputs) MLX multiplies that as it is, where a 2-D
    weight costs a flatten and an unflatten op around every product (a
    one-token step's ops are its cost); a batch of rows, or 2-D x, takes it
    2-D."""
    if (x.ndim != 3 or x.shape[0] != 1) and weight_t.ndim == 3:
        weight_t = weight_t[0]
    return x @ weight_t


class TransposedLinear(nn.Module):
    """`nn.Linear` with its weight held as `W.T` (1 x inputs x outputs,
    contiguous), a prompt's rows cut over `prompt_streams` streams."""

    def __init__(self, weight_t: Any, bias: Any = None, prompt_streams: int = 1) -> None:
        super().__init__()
        self.weight_t = weight_t
        if bias is not None:
            self.bias = bias
        self.prompt_streams = prompt_streams

    @property
    def weight(self) -> Any:  # for code that reads a layer's shape or dtype (lazy: nothing copied until read)
        return self["weight_t"][0].T

    def __call__(self, x: Any) -> Any:
        weight_t = self["weight_t"]
        y = _by_prompt_rows(x, lambda rows: transposed_product(rows, weight_t), self.prompt_streams)
        return y + self["bias"] if "bias" in self else y


class StoredLinear(nn.Linear):
    """`nn.Linear` as stored (a layer that narrows: sgemv reads it faster
    so), a prompt's rows cut over `prompt_streams` streams."""

    def __init__(self, linear: nn.Linear, prompt_streams: int) -> None:
        super().__init__(1, 1, bias="bias" in linear)
        self.update(dict(linear.items()))  # the same arrays
        self.prompt_streams = prompt_streams

    def __call__(self, x: Any) -> Any:
        return _by_prompt_rows(x, super().__call__, self.prompt_streams)


class TransposedEmbedding(nn.Module):
    """`nn.Embedding` with its table held as `W.T` (dims x vocabulary, contiguous)."""

    def __init__(self, weight_t: Any) -> None:
        super().__init__()
        self.weight_t = weight_t

    @property
    def weight(self) -> Any:
        return self["weight_t"].T

    def __call__(self, x: Any) -> Any:
        weight_t = self["weight_t"]
        return mx.moveaxis(mx.take(weight_t, mx.minimum(x, weight_t.shape[1] - 1), axis=1), 0, -1)

    def as_linear(self, x: Any) -> Any:  # a tied output head
        return transposed_product(x, self["weight_t"])


def transpose_linears(model: Any, prompt_streams: int = 1) -> int:
    """Every plain `nn.Embedding` of the model, and every plain `nn.Linear`
    that `transposes`, replaced by its transposed kind (lazily: the copies
    are made when the weights are evaluated, and the stored ones let go);
    the other Linear layers kept as stored (StoredLinear). A prompt's rows
    cut over `prompt_streams` streams in each. The number transposed."""

    def transposed(m: Any) -> Any:
        weight = m["weight"]  # (outputs, inputs)
        if type(m) is nn.Linear and not transposes(weight.shape[1], weight.shape[0]):
            return StoredLinear(m, prompt_streams)
        weight_t = mx.contiguous(weight.T)
        if type(m) is nn.Embedding:  # its lookup takes columns of the 2-D table
            return TransposedEmbedding(weight_t)
        return TransposedLinear(weight_t[None], m.get("bias"), prompt_streams)

    replaced = [(name, transposed(m)) for name, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return sum(type(m) is not StoredLinear for _, m in replaced)


class SharedInputProduct(TransposedLinear):
    """Transposed Linear layers that read the same input -- an attention's
    query, key and value projections -- held as one TransposedLinear of
    weight [W_a.T | W_b.T | ...] (1 x inputs x their outputs): one
    matrix-vector product serves them all (the narrow key and value
    projections read slowly alone), the shared weight transposed as any
    layer that widens. `layer(i)` stands in for layer i where the model
    calls it."""

    def __init__(self, layers: list[Any]) -> None:
        """`layers`: plain nn.Linear, StoredLinear or TransposedLinear (lazy:
        the shared weight is made when it is evaluated)."""
        blocks = [m["weight_t"] if type(m) is TransposedLinear else m["weight"].T[None] for m in layers]
        bias = mx.concatenate([m["bias"] for m in layers]) if all("bias" in m for m in layers) else None
        super().__init__(mx.concatenate(blocks, axis=-1), bias,
                         prompt_streams=max(getattr(m, "prompt_streams", 1) for m in layers))
        widths = [b.shape[-1] for b in blocks]
        starts = [sum(widths[:i]) for i in range(len(widths) + 1)]
        # Plain attributes, outside the parameter tree (nn.Module keeps tuples and arrays in it).
        object.__setattr__(self, "bounds", tuple(zip(starts, starts[1:])))
        object.__setattr__(self, "_last", None)  # (input, product) while its layers are being called

    def columns(self, x: Any, i: int) -> Any:
        """Layer i's output for `x`. Its layers called one after another
        with the same input (mlx-lm's prompt path) share one product; the
        last of them lets it go, so no activation outlives its step."""
        last = self._last
        y = last[1] if last is not None and last[0] is x else self(x)
        object.__setattr__(self, "_last", None if i == len(self.bounds) - 1 else (x, y))
        a, b = self.bounds[i]
        return y[..., a:b]

    def layer(self, i: int) -> "SharedColumns":
        return SharedColumns(self, i)


class SharedColumns(nn.Module):
    """Layer i of a SharedInputProduct, where the model calls it (no
    parameters of its own: they are the shared product's)."""

    def __init__(self, shared: SharedInputProduct, i: int) -> None:
        super().__init__()
        object.__setattr__(self, "shared", shared)  # not a child: its parameters live once, where the model holds it
        self.index = i

    @property
    def weight(self) -> Any:  # for code that reads a layer's shape or dtype
        a, b = self.shared.bounds[self.index]
        return self.shared["weight_t"][0, :, a:b].T

    def __call__(self, x: Any) -> Any:
        return self.shared.columns(x, self.index)
