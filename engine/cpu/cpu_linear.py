"""The CPU's float32 path, second half: Linear and Embedding layers keep
their weight transposed (optionally in column blocks on parallel CPU streams).

A decoded token reads every weight once through a matrix-vector product, so
memory bandwidth sets the decode speed. What pays:
- **Transposed** (the default). MLX's `Linear` computes `x @ W.T`;
  OpenBLAS's product in that layout ran at 6.3 GB/s on 2 cores where `x @ W`
  ran at 13.0 (bench/cpu_path.py, docs/BENCHMARKS.md): the default model in
  process, 8.5 -> 10.5 tok/s. Through sgemv (engine/cpu/fast_blas.py's shim) the
  layout still pays on the wide layers and the output head (one thread:
  11-14 GB/s against 7-8). A tied output head (`embed_tokens.as_linear`, 21 % of
  the default model's weights) is the same product, so the embedding is held
  transposed too, its lookup reading a column per token (no second copy).
- **Split** (`MLXD_CPU_LAYOUT=split`). A wide layer cut into column blocks,
  each multiplied on its own MLX CPU stream (a thread) and joined (exact:
  each output is the same dot product). Through sgemm, which packs the
  weights first, one core read ~6 GB/s and two streams made the default
  model's decode step 1.25-1.4x faster on 2 idle cores. Through sgemv one
  core reads 11-14 GB/s, what memory gives two here: split served 14.7
  tok/s where one stream served 15.3, with 1.54 cores busy against 1.26 --
  so one stream is the default, and split stays to compare on other
  machines.
- **A prompt's rows on two streams.** A prompt's products compute rather
  than read (sgemm, one OpenBLAS thread: the engine keeps OpenBLAS's own
  threads at half the cores, since they spin on busy cores), so the rows of
  a prompt (64 or more) are cut over two streams: prefilling 512 tokens of
  the default model in process, 121 -> 138 tok/s side by side.
Only the float32 CPU path uses it (engine/model/model_load.py load_resident): on
Metal and CUDA, and for quantised weights, MLX's own kernels read `W` as
stored. `MLXD_CPU_LAYOUT` = stored | transposed | split picks one to compare
(bench/cpu_path.py's arms); unset, transposed.
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

LAYOUT_ENV = "MLXD_CPU_LAYOUT"
SPLIT_MIN_OUTPUTS = 512  # narrower layers (a small model's k/v projections) lose more to the join than they gain
MAX_BLOCKS = 2  # one stream per core of a 2-core machine (more blocks were not measured)


def cpu_layout(setting: str | None, cores: int) -> tuple[bool, int, int]:
    """(transpose the weights, column blocks per wide layer, streams a
    prompt's rows are cut over) for an `MLXD_CPU_LAYOUT` value and the cores
    this process may use (pure). An unknown value is the default (the
    engine logs what it chose)."""
    value = (setting or "").strip().lower()
    if value == "stored":
        return False, 1, 1
    if value == "split" and cores >= 2:
        return True, min(MAX_BLOCKS, cores), 1  # a prompt's products already run on the blocks' streams
    return True, 1, min(MAX_BLOCKS, max(1, cores))


def transposes(inputs: int, outputs: int, blocks: int) -> bool:
    """Whether a Linear layer is held transposed (pure). On one stream, a
    layer at least as wide as its inputs: through sgemv a narrowing one (an
    MLP's down projection) reads faster as stored, 1536 -> 576 at 11.7 GB/s
    against 8.3, where 576 -> 1536 reads 12.7 transposed against 7.7
    (bench/one_row_products.py). Split, every one: the MLP's chains per
    stream take the down projection in row blocks (engine/cpu/cpu_decode.py)."""
    return blocks > 1 or outputs >= inputs


def column_blocks(outputs: int, blocks: int) -> list[tuple[int, int]]:
    """[start, stop) of each block of a layer's `outputs` columns (pure):
    one block below SPLIT_MIN_OUTPUTS, else `blocks` near-equal ones."""
    if blocks < 2 or outputs < SPLIT_MIN_OUTPUTS:
        return [(0, outputs)]
    bounds = [outputs * i // blocks for i in range(blocks + 1)]
    return list(zip(bounds, bounds[1:]))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity call
        return os.cpu_count() or 1


_streams: list[Any] = []


def block_stream(i: int) -> Any:
    """The CPU stream block `i` runs on: the first on the caller's (the
    generation stream), the others on streams of their own, made once."""
    if i == 0:
        return None
    while len(_streams) < i:
        _streams.append(mx.new_stream(mx.cpu))
    return _streams[i - 1]


def on_block_stream(i: int) -> Any:
    """`with on_block_stream(i):` the ops built inside run on block i's stream."""
    stream = block_stream(i)
    return mx.stream(stream) if stream is not None else nullcontext()


def _product(x: Any, parts: list[Any]) -> Any:
    """x @ [part_0 | part_1 | ...], each block on its own stream. A block is
    held as 1 x inputs x outputs: for one sequence (x: 1 x L x inputs) MLX
    multiplies that as it is, where a 2-D weight costs a flatten and an
    unflatten op around every product (a one-token step's ops are its cost)."""
    if x.ndim != 3 or x.shape[0] != 1:  # a batch of rows, or 2-D: one product of every row
        parts = _two_d(parts)
    if len(parts) == 1:
        return x @ parts[0]
    return mx.concatenate([mx.matmul(x, p, stream=block_stream(i)) for i, p in enumerate(parts)], axis=-1)


PROMPT_SPLIT_MIN_ROWS = 64  # fewer rows (a token, a batch's decode step) read memory: one stream


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
        with on_block_stream(i):
            outs.append(product(x[..., a:b, :]))
    return mx.concatenate(outs, axis=-2)


def _row_product(x: Any, parts: list[Any]) -> Any:
    """x @ [part_0 ; part_1 ; ...] for row blocks: the sum of each block's
    product with its slice of x, each on its own stream."""
    if x.ndim != 3 or x.shape[0] != 1:
        parts = _two_d(parts)
    products, start = [], 0
    for i, p in enumerate(parts):
        size = p.shape[-2]
        products.append(mx.matmul(x[..., start:start + size], p, stream=block_stream(i)))
        start += size
    return sum(products[1:], products[0])


def _two_d(parts: list[Any]) -> list[Any]:
    return [p[0] if p.ndim == 3 else p for p in parts]


def _stored(parts: list[Any], rows: bool = False) -> Any:
    """The weight as nn.Linear holds it (lazy: nothing is copied until read)."""
    blocks = _two_d(parts)
    return (blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0 if rows else 1)).T


class TransposedLinear(nn.Module):
    """`nn.Linear` with its weight held as `W.T`, contiguous, in column
    blocks (each 1 x inputs x outputs), or in row blocks (`rows`: blocks of
    its inputs, whose products are summed: an MLP's down projection, so
    that each stream goes on from its own block of the gate and up
    projections, engine/cpu/cpu_decode.py)."""

    def __init__(self, parts: list[Any], bias: Any = None, rows: bool = False, prompt_streams: int = 1) -> None:
        super().__init__()
        self.parts = parts
        if bias is not None:
            self.bias = bias
        self.rows = rows
        self.prompt_streams = prompt_streams

    @property
    def weight(self) -> Any:  # for code that reads a layer's shape or dtype
        return _stored(self["parts"], self.rows)

    def by_rows(self, blocks: int) -> "TransposedLinear":
        """The same layer with its inputs cut as `column_blocks` cuts a
        layer of that many outputs (lazy)."""
        parts = self["parts"]
        whole = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        bounds = column_blocks(whole.shape[-2], blocks)
        return TransposedLinear([mx.contiguous(whole[:, a:b]) for a, b in bounds], self.get("bias"), rows=True)

    def __call__(self, x: Any) -> Any:
        parts = self["parts"]
        y = (_row_product(x, parts) if self.rows else
             _by_prompt_rows(x, lambda rows: _product(rows, parts), self.prompt_streams))
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
    """`nn.Embedding` with its table held as `W.T`, contiguous, in column blocks."""

    def __init__(self, parts: list[Any]) -> None:
        super().__init__()
        self.parts = parts

    @property
    def weight(self) -> Any:
        return _stored(self["parts"])

    def __call__(self, x: Any) -> Any:
        parts = self["parts"]
        rows = mx.take(parts[0], mx.minimum(x, parts[0].shape[1] - 1), axis=1)
        start = parts[0].shape[1]
        for part in parts[1:]:  # an id past a block's start is looked up in that block
            size = part.shape[1]
            here = mx.take(part, mx.clip(x - start, 0, size - 1), axis=1)
            rows = mx.where(x >= start, here, rows)
            start += size
        return mx.moveaxis(rows, 0, -1)

    def as_linear(self, x: Any) -> Any:  # a tied output head
        return _product(x, self["parts"])


def transpose_linears(model: Any, blocks: int = 1, prompt_streams: int = 1) -> int:
    """Every plain `nn.Embedding` of the model, and every plain `nn.Linear`
    that `transposes`, replaced by its transposed kind, a layer of
    SPLIT_MIN_OUTPUTS or more outputs in `blocks` column blocks (lazily: the
    copies are made when the weights are evaluated, and the stored ones let
    go); the other Linear layers kept as stored (StoredLinear). A prompt's
    rows cut over `prompt_streams` streams in each. The number transposed."""

    def transposed(m: Any) -> Any:
        weight = m["weight"]  # (outputs, inputs)
        if type(m) is nn.Linear and not transposes(weight.shape[1], weight.shape[0], blocks):
            return StoredLinear(m, prompt_streams)
        parts = [mx.contiguous(weight[a:b].T) for a, b in column_blocks(weight.shape[0], blocks)]
        if type(m) is nn.Embedding:  # its lookup takes columns of the 2-D table
            return TransposedEmbedding(parts)
        return TransposedLinear([p[None] for p in parts], m.get("bias"), prompt_streams=prompt_streams)

    replaced = [(name, transposed(m)) for name, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return sum(type(m) is not StoredLinear for _, m in replaced)


class SharedInputProduct(TransposedLinear):
    """Transposed Linear layers that read the same input -- an attention's
    query, key and value projections -- held as one TransposedLinear of
    weight [W_a.T | W_b.T | ...] (1 x inputs x their outputs): one
    matrix-vector product serves them all (through sgemv the narrow key and
    value projections read ~7 GB/s alone; the step ~6 % faster side by
    side), the shared weight transposed as any layer that widens.
    `layer(i)` stands in for layer i where the model calls it."""

    def __init__(self, layers: list[Any]) -> None:
        """`layers`: plain nn.Linear or TransposedLinear in one block (lazy:
        the shared weight is made when it is evaluated)."""
        blocks = [m["parts"][0] if type(m) is TransposedLinear else m["weight"].T[None] for m in layers]
        bias = mx.concatenate([m["bias"] for m in layers]) if all("bias" in m for m in layers) else None
        super().__init__([mx.concatenate(blocks, axis=-1)], bias,
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
        return self.shared["parts"][0][0, :, a:b].T

    def __call__(self, x: Any) -> Any:
        return self.shared.columns(x, self.index)
