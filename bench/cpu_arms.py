"""The CPU float32 path's layouts, kept only to compare against the engine's
default (engine/cpu/): applied to a loaded float32 model by
bench/cpu_path.py's arms, in the engine process the benchmark starts.

  stored       mlx-lm's model as it is: Linear weights as MLX lays them
               out (`x @ W.T`), MLX's own ops for every step
  transposed   the engine's default (engine/cpu/cpu_decode.py's
               prepare_float32), named
  split        every Linear and Embedding layer transposed, a wide one (512
               outputs or more) in column blocks, each multiplied on its own
               MLX CPU stream (a thread) and joined (exact: each output is
               the same dot product); the one-token shortcuts, and a token's
               SwiGLU MLP as one chain per stream (gate and up column block
               i, its SwiGLU and the down projection's row block i on stream
               i, joined once). A block per core, at most MAX_BLOCKS; on one
               core, the default's layout on one stream.

What each measured, and why the engine keeps only the transposed one:
docs/BENCHMARKS.md, "The CPU path's layouts: measured arms (engine/cpu/)".
`install(layout)` puts a layout in place of the engine's in this process:
bench/cpu_path.py's `--engine-layout` runs `mlxd engine` so.

MLX at import (as engine/cpu/'s modules): import it after the engine's BLAS
is chosen (engine/cpu/fast_blas.py's activate()).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models import llama, qwen2
from mlx_lm.models.activations import swiglu

from mlxd.engine.cpu import cpu_decode
from mlxd.engine.cpu.cpu_decode import shorten_decode
from mlxd.engine.cpu.cpu_linear import (TransposedEmbedding, TransposedLinear, cpu_stream, on_stream,
                                        transpose_linears, usable_cores)

LAYOUTS = ("stored", "transposed", "split")
SPLIT_MIN_OUTPUTS = 512  # narrower layers (a small model's k/v projections) lose more to the join than they gain
MAX_BLOCKS = 2  # one stream per core of a 2-core machine (more blocks were not measured)
SPLIT_LOG = "transposed, wide layers in {blocks} column blocks on parallel CPU streams"

_engine_prepare = cpu_decode.prepare_float32  # the engine's own, before install() replaces it


def layout_plan(layout: str, cores: int) -> tuple[bool, int, int]:
    """(transpose the weights, column blocks per wide layer, streams a
    prompt's rows are cut over) for a layout and the cores this process may
    use (pure)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CPU layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if layout == "stored":
        return False, 1, 1
    if layout == "split" and cores >= 2:
        return True, min(MAX_BLOCKS, cores), 1  # a prompt's products already run on the blocks' streams
    if layout == "split":
        return True, 1, 1  # one core: no stream of its own for a second block
    return True, 1, min(MAX_BLOCKS, max(1, cores))


def column_blocks(outputs: int, blocks: int) -> list[tuple[int, int]]:
    """[start, stop) of each block of a layer's `outputs` columns (pure):
    one block below SPLIT_MIN_OUTPUTS, else `blocks` near-equal ones."""
    if blocks < 2 or outputs < SPLIT_MIN_OUTPUTS:
        return [(0, outputs)]
    bounds = [outputs * i // blocks for i in range(blocks + 1)]
    return list(zip(bounds, bounds[1:]))


def _two_d(parts: list[Any]) -> list[Any]:
    return [p[0] if p.ndim == 3 else p for p in parts]


def _column_product(x: Any, parts: list[Any]) -> Any:
    """x @ [part_0 | part_1 | ...], each block on its own stream (a block
    1 x inputs x outputs for one sequence, as the engine's TransposedLinear)."""
    if x.ndim != 3 or x.shape[0] != 1:  # a batch of rows, or 2-D: one product of every row
        parts = _two_d(parts)
    if len(parts) == 1:
        return x @ parts[0]
    return mx.concatenate([mx.matmul(x, p, stream=cpu_stream(i)) for i, p in enumerate(parts)], axis=-1)


def _row_product(x: Any, parts: list[Any]) -> Any:
    """x @ [part_0 ; part_1 ; ...] for row blocks: the sum of each block's
    product with its slice of x, each on its own stream."""
    if x.ndim != 3 or x.shape[0] != 1:
        parts = _two_d(parts)
    products, start = [], 0
    for i, p in enumerate(parts):
        size = p.shape[-2]
        products.append(mx.matmul(x[..., start:start + size], p, stream=cpu_stream(i)))
        start += size
    return sum(products[1:], products[0])


class ColumnBlocks(nn.Module):
    """`nn.Linear` with its weight held as `W.T` in column blocks (each
    1 x inputs x outputs), or in row blocks (`rows`: blocks of its inputs,
    whose products are summed: an MLP's down projection, so that each
    stream goes on from its own block of the gate and up projections)."""

    def __init__(self, parts: list[Any], bias: Any = None, rows: bool = False) -> None:
        super().__init__()
        self.parts = parts
        if bias is not None:
            self.bias = bias
        self.rows = rows

    @property
    def weight(self) -> Any:  # the weight as nn.Linear holds it (lazy)
        blocks = _two_d(self["parts"])
        return (blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0 if self.rows else 1)).T

    def __call__(self, x: Any) -> Any:
        parts = self["parts"]
        y = _row_product(x, parts) if self.rows else _column_product(x, parts)
        return y + self["bias"] if "bias" in self else y


def by_rows(layer: Any, blocks: int) -> ColumnBlocks:
    """A transposed layer (ColumnBlocks or the engine's TransposedLinear)
    with its inputs cut as `column_blocks` cuts a layer of that many
    outputs (lazy)."""
    parts = layer["parts"] if type(layer) is ColumnBlocks else [layer["weight_t"]]
    whole = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    bounds = column_blocks(whole.shape[-2], blocks)
    return ColumnBlocks([mx.contiguous(whole[:, a:b]) for a, b in bounds], layer.get("bias"), rows=True)


class BlockedEmbedding(nn.Module):
    """`nn.Embedding` with its table held as `W.T`, contiguous, in column blocks."""

    def __init__(self, parts: list[Any]) -> None:
        super().__init__()
        self.parts = parts

    @property
    def weight(self) -> Any:
        return mx.concatenate(self["parts"], axis=1).T

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
        return _column_product(x, self["parts"])


def split_linears(model: Any, blocks: int) -> int:
    """Every plain `nn.Linear` and `nn.Embedding` of the model held
    transposed, one of SPLIT_MIN_OUTPUTS or more outputs in `blocks` column
    blocks (ColumnBlocks, BlockedEmbedding), a narrower one as the engine's
    TransposedLinear / TransposedEmbedding on one stream (lazily). The
    number replaced."""

    def split(m: Any) -> Any:
        weight = m["weight"]  # (outputs, inputs)
        parts = [mx.contiguous(weight[a:b].T) for a, b in column_blocks(weight.shape[0], blocks)]
        if type(m) is nn.Embedding:  # its lookup takes columns of the 2-D table
            return TransposedEmbedding(parts[0]) if len(parts) == 1 else BlockedEmbedding(parts)
        if len(parts) == 1:
            return TransposedLinear(parts[0][None], m.get("bias"))
        return ColumnBlocks([p[None] for p in parts], m.get("bias"))

    replaced = [(name, split(m)) for name, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return len(replaced)


class _BlockedCall:
    """mlx-lm's SwiGLU MLP, a token at a time as one chain per stream: block
    i of the gate and up projections, its SwiGLU, and row block i of the
    down projection, on stream i; the partial outputs summed (the streams
    join once, not after each projection)."""

    def __call__(self, x: Any) -> Any:
        if x.ndim != 3 or x.shape[:2] != (1, 1):
            return super().__call__(x)  # type: ignore[misc]
        gate, up, down = (self[k]["parts"] for k in ("gate_proj", "up_proj", "down_proj"))  # type: ignore[index]
        partial_sums = []
        for i, (g, u, d) in enumerate(zip(gate, up, down)):
            with on_stream(i):  # block 0: the caller's own stream
                partial_sums.append(swiglu(x @ g, x @ u) @ d)
        return sum(partial_sums[1:], partial_sums[0])


class BlockedLlamaMLP(_BlockedCall, llama.MLP):
    pass


class BlockedQwen2MLP(_BlockedCall, qwen2.MLP):
    pass


BLOCKED = {llama.MLP: BlockedLlamaMLP, qwen2.MLP: BlockedQwen2MLP}


def _blockable(mlp: Any) -> bool:
    """Gate and up in the same column blocks (2 or more), the down
    projection transposed (in column blocks or one), no biases."""
    layers = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all((type(m) is TransposedLinear or (type(m) is ColumnBlocks and not m.rows)) and "bias" not in m
               for m in layers):
        return False
    if type(mlp.gate_proj) is not ColumnBlocks or type(mlp.up_proj) is not ColumnBlocks:
        return False
    gate, up = mlp.gate_proj["parts"], mlp.up_proj["parts"]
    return len(gate) > 1 and [p.shape for p in gate] == [p.shape for p in up] == [
        (1, gate[0].shape[1], b - a) for a, b in column_blocks(mlp.down_proj.weight.shape[1], len(gate))]


def block_mlps(model: Any) -> int:
    """Every Llama / Qwen2 MLP in column blocks made a chain per stream, its
    down projection in row blocks as the gate's and up's column blocks. The
    number changed."""
    changed = 0
    for _, m in model.named_modules():
        if type(m) in BLOCKED and _blockable(m):
            m.down_proj = by_rows(m.down_proj, len(m.gate_proj["parts"]))
            m.__class__ = BLOCKED[type(m)]
            changed += 1
    return changed


def apply_layout(model: Any, layout: str, cores: int | None = None) -> str:
    """The layout applied to a model already cast to float32 (in place of
    the engine's prepare_float32); what it did, for the log."""
    transpose, blocks, prompt_streams = layout_plan(layout, usable_cores() if cores is None else cores)
    if not transpose:
        return "as stored"
    if layout == "transposed":
        return _engine_prepare(model)
    if blocks == 1:
        transpose_linears(model, prompt_streams)
        shorten_decode(model)
        return f"transposed, a prompt's rows on {prompt_streams} CPU stream(s)"
    split_linears(model, blocks)
    shorten_decode(model)
    block_mlps(model)
    return SPLIT_LOG.format(blocks=blocks)


def install(layout: str) -> None:
    """The engine's model load in this process applies `layout` instead of
    its own (engine/model/model_load.py calls cpu_decode.prepare_float32)."""
    layout_plan(layout, 1)  # an unknown layout fails here, not at the load
    cpu_decode.prepare_float32 = lambda model: apply_layout(model, layout)
