"""A conversation's KV on disk as a chain of blocks.

Block i of a conversation holds the KV of its tokens [i*B, (i+1)*B) (the
last block fewer), every layer, in one safetensors file under kv/blocks/,
named by a hash of the model build and the cache's layout, the previous
block's hash and the block's own tokens: the hash-block scheme of vLLM's
prefix cache and mlx-lm's server, on disk. Two conversations that share a
prefix share its blocks, and a turn writes only the blocks its new tokens
made (and the last, partial block again): a conversation's KV reaches disk
as it grows, not whole again every turn.

Only layers that can be cut along their positions are stored so: mlx-lm's
KVCache and QuantizedKVCache. A model with other layers (a rotating window,
recurrent state) keeps whole-entry files (engine/cache/kv_files.py).

`block_spans`, `chain_hashes` and `layer_layout` are pure; `stage_blocks` and
`assemble` run on the worker thread (they make and read MLX arrays); the
writer thread only reads the block's own copies (numpy's on the CPU, the
device's on a GPU: it reads them to the host).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .kv_writer import SAFETENSORS_DTYPES, StagedFile, host_view, safetensors_header

# Tokens a block holds: small enough that a turn rewrites little beyond what
# is new (at most one partial block), large enough that a long conversation
# is tens of files, not thousands (an 8B model's block is 32 MiB in bf16).
BLOCK_TOKENS = 256
PLAIN = "kv"  # a layer_layout entry: mlx-lm's KVCache


def block_spans(n_tokens: int, block_tokens: int = BLOCK_TOKENS) -> list[tuple[int, int]]:
    """The [start, end) of each block of a conversation of n tokens (pure)."""
    return [(s, min(s + block_tokens, n_tokens)) for s in range(0, n_tokens, block_tokens)]


def chain_hashes(seed: str, tokens: np.ndarray, block_tokens: int = BLOCK_TOKENS) -> list[str]:
    """Each block's name: a hash of the one before it and its tokens, from
    `seed` (the model build and the layout), so a block names its whole
    prefix (pure)."""
    out, parent = [], hashlib.sha256(seed.encode()).hexdigest()[:32]
    for start, end in block_spans(len(tokens), block_tokens):
        parent = hashlib.sha256(parent.encode() + np.asarray(tokens[start:end], dtype="<i4").tobytes()).hexdigest()[:32]
        out.append(parent)
    return out


def layer_layout(kv: Sequence[Any]) -> list[str] | None:
    """Each layer's kind as blocks store it ("kv", or "q<bits>g<group>" for
    quantised KV), or None when a layer cannot be cut into blocks."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out = []
    for c in kv:
        if isinstance(c, QuantizedKVCache) and c.keys is not None:
            out.append(f"q{c.bits}g{c.group_size}")
        elif isinstance(c, KVCache) and c.keys is not None:
            out.append(PLAIN)
        else:
            return None
    return out or None


def bytes_per_token(kv: Sequence[Any]) -> float:
    """Bytes one position of this cache takes, every layer (its arrays' own
    figures; no MLX call)."""
    total = 0.0
    for c in kv:
        for a in (*c.keys, *c.values) if isinstance(c.keys, (tuple, list)) else (c.keys, c.values):
            total += a.nbytes / max(a.shape[2], 1)
    return total


def _layer_buffers(c: Any) -> list[tuple[str, Any]]:
    """(suffix, array) of one layer's keys and values (a quantised layer's three each)."""
    if isinstance(c.keys, (tuple, list)):
        return [(f"k.{i}", a) for i, a in enumerate(c.keys)] + [(f"v.{i}", a) for i, a in enumerate(c.values)]
    return [("k", c.keys), ("v", c.values)]


def stage_block(final: Path, tmp: Path, kv: Sequence[Any], span: tuple[int, int],
                metadata: dict[str, str], on_device: bool | None = None) -> StagedFile:
    """One block's file staged for the writer: copies of the span's KV, so
    the cache's own buffers are free to go, or to be written past, while the
    file is written (worker thread; it reads MLX arrays).

    On a GPU the copies are the device's own (`on_device`; None: where the
    KV lives), queued and not waited for: the writer's thread reads them to
    the host. A host copy here would wait for the step under way and then
    move the block's bytes on the worker thread, between two decode steps
    (a 2,048-token block of an 8B model is 256 MiB: ~0.36 s on the lent
    H100, where a device array is read page by page). On the CPU they are
    numpy's, made from views of the buffers with no MLX op (MLX copies, or
    even bit views, cost ~0.1 ms an array there: a small model's decode
    step for a block)."""
    import mlx.core as mx

    start, end = span
    if on_device is None:
        on_device = mx.default_device() == mx.gpu
    tensors, parts = [], []
    for layer, c in enumerate(kv):
        for suffix, whole in _layer_buffers(c):
            dtype = str(whole.dtype).removeprefix("mlx.core.")
            part = (mx.contiguous(whole[..., start:end, :]) if on_device
                    else np.array(host_view(whole)[..., start:end, :], copy=True))
            parts.append(part)
            tensors.append((f"{layer}.{suffix}", SAFETENSORS_DTYPES[dtype], tuple(part.shape), int(part.nbytes)))
    if on_device:
        mx.async_eval(parts)  # the copies run with the next step; the writer's read waits for them, not the worker
    header = safetensors_header(tensors, {**metadata, "tokens": str(end - start)})
    return StagedFile(final, tmp, header, parts, len(header) + sum(t[3] for t in tensors))


def stage_blocks(files: Sequence[tuple[Path, Path]], kv: Sequence[Any], spans: Sequence[tuple[int, int]],
                 metadata: dict[str, str], on_device: bool | None = None) -> list[StagedFile]:
    """Blocks' files staged for the writer, one a span (`files`: each one's
    final and temporary path), as `stage_block` stages each. On a GPU a run
    of whole, consecutive blocks is copied by one device op a layer's buffer
    (its positions cut into blocks, the blocks laid one after another), each
    block's arrays then views of that copy: a turn's tens of blocks cost the
    worker tens of MLX ops, not thousands (85 blocks one by one held every
    other row's step for ~0.9 s on the lent H100)."""
    import mlx.core as mx

    if on_device is None:
        on_device = mx.default_device() == mx.gpu
    out: list[StagedFile | None] = [None] * len(spans)
    i = 0
    while i < len(spans):
        j = i
        while on_device and j + 1 < len(spans) and spans[j + 1][0] == spans[j][1] and \
                spans[j + 1][1] - spans[j + 1][0] == BLOCK_TOKENS and spans[i][1] - spans[i][0] == BLOCK_TOKENS:
            j += 1
        if j == i:
            out[i] = stage_block(*files[i], kv, spans[i], metadata, on_device=on_device)
        else:
            out[i:j + 1] = _stage_run(files[i:j + 1], kv, spans[i][0], j + 1 - i, metadata)
        i = j + 1
    return out  # type: ignore[return-value]


def _stage_run(files: Sequence[tuple[Path, Path]], kv: Sequence[Any], start: int, n: int,
               metadata: dict[str, str]) -> list[StagedFile]:
    """`n` whole blocks from position `start`, on the device: see stage_blocks."""
    import mlx.core as mx

    size = BLOCK_TOKENS
    tensors: list[list[tuple[str, str, tuple[int, ...], int]]] = [[] for _ in range(n)]
    parts: list[list[Any]] = [[] for _ in range(n)]
    for layer, c in enumerate(kv):
        for suffix, whole in _layer_buffers(c):
            dtype = str(whole.dtype).removeprefix("mlx.core.")
            run = whole[..., start:start + n * size, :]
            lead, width = run.shape[:-2], run.shape[-1]
            laid = mx.contiguous(mx.moveaxis(run.reshape(*lead, n, size, width), -3, 0))  # block k's bytes: laid[k]
            for k, piece in enumerate(mx.split(laid, n, axis=0)):
                parts[k].append(piece)
                tensors[k].append((f"{layer}.{suffix}", SAFETENSORS_DTYPES[dtype], (*lead, size, width),
                                   int(laid.nbytes) // n))
    mx.async_eval([p for block in parts for p in block])  # with the next step; the writer's read waits for them
    out = []
    for k, (final, tmp) in enumerate(files):
        header = safetensors_header(tensors[k], {**metadata, "tokens": str(size)})
        out.append(StagedFile(final, tmp, header, parts[k], len(header) + sum(t[3] for t in tensors[k])))
    return out


class BlockError(Exception):
    """A block file that does not hold what its name promises."""


def read_block(path: Path, layout: Sequence[str], tokens: int) -> dict[str, Any]:
    """A block's arrays, read now (mx.load is lazy) and checked against the
    layout and its token count (worker thread)."""
    import mlx.core as mx

    try:
        arrays = mx.load(str(path))
        mx.eval(list(arrays.values()))
    except (OSError, RuntimeError, ValueError) as exc:
        raise BlockError(f"{path.name}: {exc}") from None
    for layer, kind in enumerate(layout):
        names = ["k", "v"] if kind == PLAIN else [f"{x}.{i}" for x in "kv" for i in range(3)]
        for n in names:
            a = arrays.get(f"{layer}.{n}")
            if a is None or a.ndim != 4 or a.shape[2] != tokens:
                raise BlockError(f"{path.name} does not hold layer {layer}'s {n} for {tokens} tokens")
    return arrays


def assemble(layout: Sequence[str], blocks: Sequence[dict[str, Any]]) -> list[Any]:
    """The conversation's cache from its blocks, in order: mlx-lm's own
    classes, each layer one array of exactly its positions (worker thread)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out, fresh = [], []
    for layer, kind in enumerate(layout):
        def joined(name: str) -> Any:
            parts = [b[f"{layer}.{name}"] for b in blocks]
            a = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
            fresh.append(a)
            return a

        if kind == PLAIN:
            c = KVCache()
            c.keys, c.values = joined("k"), joined("v")
        else:
            bits, group = (int(x) for x in kind[1:].split("g"))
            c = QuantizedKVCache(group_size=group, bits=bits)
            c.keys = tuple(joined(f"k.{i}") for i in range(3))
            c.values = tuple(joined(f"v.{i}") for i in range(3))
        c.offset = sum(b[f"{layer}.{'k' if kind == PLAIN else 'k.0'}"].shape[2] for b in blocks)
        out.append(c)
    mx.eval(fresh)
    return out
