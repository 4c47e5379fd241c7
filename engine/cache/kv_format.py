"""The disk tier's files, as written and read (engine/cache/kv_files.py keeps them).

An entry of a model whose KV can be cut along its positions (attention
layers: most models) is a manifest, kv/<name>.json -- its tokens, what the
reuse plan needs, and the hashes of its blocks -- over content-addressed
blocks of 256 tokens in kv/blocks/ (engine/cache/kv_blocks.py). An entry of
another model (a rotating window, recurrent layers) is one safetensors file,
kv/<name>.safetensors, in mlx-lm's prompt-cache format (`save_prompt_cache`),
with its tokens and provenance in the file's metadata. Here: an entry's row
in the index (`DiskEntry`), what a file must have been written with to be
read back (`versions`), a manifest's JSON and a file's header parsed and
checked (pure but for reading a header), an entry's name.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .kv_blocks import block_spans

FORMAT = "mlxd-kv-1"
MAX_HEADER_BYTES = 64 * 2**20  # tokens live in the header: 100k tokens take ~0.5 MB


class KVFileError(Exception):
    """An entry file that cannot be used (it has been deleted)."""


@dataclass(frozen=True, eq=False)
class DiskEntry:
    path: Path  # its manifest (kv/<name>.json), or its whole file (kv/<name>.safetensors)
    model_key: str
    tokens: np.ndarray
    prompt_len: int
    trimmable: bool
    nbytes: int  # the KV's bytes on disk: what reading it takes
    conversation: tuple[str, ...] = ()
    patchable: bool = False  # every layer a plain KVCache (engine/cache/reuse.py)
    echo: tuple[int, ...] = ()  # its answer's first tokens as the next prompt holds them (engine/cache/reuse.py)
    blocks: tuple[str, ...] = ()  # its blocks' hashes, in order (a manifest's entry)
    layout: tuple[str, ...] = ()  # its layers as the blocks hold them (engine/cache/kv_blocks.py)
    file_bytes: int = 0  # the manifest's own size (a whole file: nbytes)


def is_patchable(kv: list[Any]) -> bool:
    """Whether spans inside this cache can be recomputed in place: every
    layer a plain KVCache, whose offset can be set back and forth."""
    from mlx_lm.models.cache import KVCache

    return bool(kv) and all(isinstance(c, KVCache) for c in kv)


def versions() -> dict[str, str]:
    """What a file must have been written with to be read back."""
    import mlx.core as mx
    import mlx_lm

    return {"format": FORMAT, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


def model_id_of(model_key: str) -> str:
    return model_key.split("@", 1)[0]


def read_header(path: Path) -> dict[str, str]:
    """The safetensors file's metadata, read without its tensors."""
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise KVFileError(f"{path.name} is truncated")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise KVFileError(f"{path.name} has a {n}-byte header")
        body = fh.read(n)
    if len(body) != n:
        raise KVFileError(f"{path.name} is truncated")
    try:
        meta = json.loads(body).get("__metadata__") or {}
    except (json.JSONDecodeError, AttributeError) as exc:
        raise KVFileError(f"{path.name} has no readable header") from exc
    # save_prompt_cache flattens [metadata, classes, scalars]: ours is "0.*".
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


def parse_entry(path: Path, meta: dict[str, str], expected: dict[str, str]) -> DiskEntry:
    """The index row for a file whose metadata is `meta` (pure but for the size)."""
    for key, want in expected.items():
        if meta.get(key) != want:
            raise KVFileError(f"{path.name} was written with {key} {meta.get(key)!r}, not {want!r}")
    try:
        tokens = np.frombuffer(base64.b64decode(meta["tokens"]), dtype="<i4").astype(np.int32)
        entry = DiskEntry(path, meta["model"], tokens, int(meta["prompt_len"]), meta["trimmable"] == "1",
                          path.stat().st_size, tuple(filter(None, meta.get("conversation", "").split(","))),
                          meta.get("patchable") == "1", tuple(int(t) for t in meta.get("echo", "").split(",") if t))
    except (KeyError, ValueError, TypeError) as exc:
        raise KVFileError(f"{path.name} has incomplete metadata") from exc
    if not len(tokens):
        raise KVFileError(f"{path.name} covers no tokens")
    return entry


def parse_manifest(path: Path, doc: Any, expected: dict[str, str], block_bytes: dict[str, int]) -> DiskEntry:
    """The index row for a manifest (pure): its blocks must all be there
    (`block_bytes`: the blocks on disk, by hash) and cover its tokens."""
    if not isinstance(doc, dict):
        raise KVFileError(f"{path.name} is not a manifest")
    for key, want in expected.items():
        if doc.get(key) != want:
            raise KVFileError(f"{path.name} was written with {key} {doc.get(key)!r}, not {want!r}")
    try:
        tokens = np.frombuffer(base64.b64decode(doc["tokens"]), dtype="<i4").astype(np.int32)
        blocks, layout = tuple(str(h) for h in doc["blocks"]), tuple(str(k) for k in doc["layout"])
        entry = DiskEntry(path, str(doc["model"]), tokens, int(doc["prompt_len"]), True, 0,
                          tuple(str(c) for c in doc.get("conversation", ())), bool(doc.get("patchable")),
                          tuple(int(t) for t in doc.get("echo", ())), blocks, layout, int(doc.get("bytes", 0)))
    except (KeyError, ValueError, TypeError) as exc:
        raise KVFileError(f"{path.name} has incomplete metadata") from exc
    if not len(tokens) or len(blocks) != len(block_spans(len(tokens))) or not layout:
        raise KVFileError(f"{path.name}: its blocks do not cover its tokens")
    missing = [h for h in blocks if h not in block_bytes]
    if missing:
        raise KVFileError(f"{path.name}: {len(missing)} of its blocks are missing")
    return replace(entry, nbytes=sum(block_bytes[h] for h in blocks))


def manifest_doc(entry: DiskEntry, expected: dict[str, str]) -> bytes:
    """A manifest's JSON (pure)."""
    return json.dumps({**expected, "model": entry.model_key, "prompt_len": entry.prompt_len,
                       "patchable": entry.patchable, "echo": list(entry.echo), "conversation": list(entry.conversation),
                       "layout": list(entry.layout), "blocks": list(entry.blocks),
                       "tokens": base64.b64encode(entry.tokens.astype("<i4").tobytes()).decode()}).encode()


def kv_nbytes(kv: list[Any]) -> int:
    """Bytes an entry's arrays really hold (buffers included)."""
    return sum(int(c.nbytes) for c in kv)


def compact(kv: list[Any]) -> list[Any]:
    """Shallow copies, as mlx-lm's own classes (the file names them), whose
    arrays hold only the tokens covered (a KV layer's buffer is allocated in
    steps, or for a whole request, and keeps what a trim cut off)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out = []
    for c in kv:
        if isinstance(c, KVCache) and c.keys is not None:
            o = c.offset
            c = KVCache.from_state((c.keys[..., :o, :], c.values[..., :o, :], o))
        elif isinstance(c, QuantizedKVCache) and c.keys is not None:
            o = c.offset
            c = QuantizedKVCache.from_state((tuple(a[..., :o, :] for a in c.keys),
                                             tuple(a[..., :o, :] for a in c.values), o, c.group_size, c.bits))
        out.append(c)
    return out


def entry_name(model_key: str, tokens: np.ndarray) -> str:
    """An entry's file name (without suffix): its model build and tokens, hashed."""
    return hashlib.sha256(model_key.encode() + tokens.astype("<i4").tobytes()).hexdigest()[:32]
