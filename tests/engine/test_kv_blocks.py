"""The disk tier's blocks (engine/cache/kv_blocks.py, engine/cache/kv_files.py):
a conversation as a chain of content-addressed blocks under a manifest. Real
files, real MLX arrays (CPU); the decisions as tables."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxd.engine.cache.kv_blocks import BLOCK_TOKENS, block_spans, chain_hashes, layer_layout
from mlxd.engine.cache.kv_files import KVFiles
from mlxd.engine.cache.kv_writer import write_all

MODEL = "m@build1"
B = BLOCK_TOKENS


@pytest.mark.parametrize("n, spans", [
    (0, []),
    (1, [(0, 1)]),
    (B, [(0, B)]),
    (B + 1, [(0, B), (B, B + 1)]),
    (3 * B - 5, [(0, B), (B, 2 * B), (2 * B, 3 * B - 5)]),
])
def test_block_spans(n, spans):
    assert block_spans(n) == spans


def test_a_block_names_its_whole_prefix():
    a = np.arange(3 * B, dtype=np.int32)
    b = a.copy()
    b[B + 7] = -1  # differs in the second block
    ha, hb = chain_hashes("seed", a), chain_hashes("seed", b)
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # the third block's tokens agree, its prefix not
    assert chain_hashes("other build", a)[0] != ha[0]
    assert chain_hashes("seed", a[: B + 10])[:1] == ha[:1] and chain_hashes("seed", a[: B + 10])[1] != ha[1]


def kv_for(tokens: np.ndarray, layers: int = 2, quantized: bool = False) -> list:
    """A cache whose every position's values come from its token: the same
    tokens give the same KV, as a model's do."""
    out = []
    for layer in range(layers):
        base = mx.array(tokens.astype(np.float32))[None, None, :, None] * (layer + 1)
        keys = mx.broadcast_to(base, (1, 2, len(tokens), 64)) + mx.arange(64, dtype=mx.float32) / 64
        keys = keys.astype(mx.bfloat16)
        values = keys * 2
        if quantized:
            c = QuantizedKVCache(group_size=32, bits=8)
            c.keys = tuple(mx.quantize(keys, group_size=32, bits=8))
            c.values = tuple(mx.quantize(values, group_size=32, bits=8))
        else:
            c = KVCache()
            c.keys, c.values = keys, values
        c.offset = len(tokens)
        out.append(c)
    mx.eval([a for c in out for a in (c.keys + c.values if quantized else (c.keys, c.values))])
    return out


def arrays(kv: list) -> list[np.ndarray]:
    out = []
    for c in kv:
        parts = (c.keys + c.values) if isinstance(c.keys, tuple) else (c.keys, c.values)
        out += [np.array(a[..., : c.offset, :].astype(mx.float32) if a.dtype == mx.bfloat16 else a[..., : c.offset, :])
                for a in parts]
    return out


def write(files: KVFiles, tokens: np.ndarray, conversation: tuple[str, ...] = (), quantized: bool = False):
    staged = files.stage(MODEL, tokens, len(tokens), kv_for(tokens, quantized=quantized), conversation)
    write_all(staged)
    staged.drop_views()
    return staged, files.commit(staged)


def block_files(folder: Path) -> set[str]:
    return {p.stem for p in (folder / "blocks").glob("*.safetensors")}


@pytest.mark.parametrize("quantized", [False, True])
def test_an_entry_reads_back_exactly_from_its_blocks(tmp_path, quantized):
    files = KVFiles(tmp_path, 2**30, ["m"])
    tokens = np.arange(2 * B + 40, dtype=np.int32)
    _, entry = write(files, tokens, quantized=quantized)
    assert len(entry.blocks) == 3 and block_files(tmp_path) == set(entry.blocks)
    assert layer_layout(kv_for(tokens[:2], quantized=quantized)) == (["q8g32"] * 2 if quantized else ["kv"] * 2)
    back = files.load(entry)
    assert all(c.offset == len(tokens) for c in back)
    for got, want in zip(arrays(back), arrays(kv_for(tokens, quantized=quantized))):
        assert np.array_equal(got, want)


def test_conversations_that_share_a_prefix_share_its_blocks_and_a_turn_writes_only_what_is_new(tmp_path):
    files = KVFiles(tmp_path, 2**30, ["m"])
    a = np.arange(2 * B + 88, dtype=np.int32)  # blocks 0, 1 and a partial one
    _, ea = write(files, a)
    b = np.concatenate([a[: 2 * B], np.full(100, 7, np.int32)])  # another conversation, the same first 512 tokens
    staged_b, eb = write(files, b)
    assert len(staged_b.new_blocks) == 1 and eb.blocks[:2] == ea.blocks[:2]  # only its own third block was written
    assert files.block_count == 4
    shared_bytes = sum(files._blocks[h].nbytes for h in ea.blocks[:2])
    assert files.total_bytes < ea.nbytes + eb.nbytes - shared_bytes + 8192  # shared blocks counted once
    # The next turn of `a`: its partial block written again, whole, and the new tokens' block; no others.
    a2 = np.concatenate([a, np.arange(200, dtype=np.int32)])
    staged_a2, ea2 = write(files, a2)
    assert list(staged_a2.new_blocks) == list(ea2.blocks[2:]) and len(ea2.blocks) == 4
    # `a`'s turn is superseded: deleted, its partial block goes, the blocks `a2` and `b` name stay.
    files.delete([ea])
    assert block_files(tmp_path) == set(ea2.blocks) | set(eb.blocks)
    files.delete([eb])
    assert block_files(tmp_path) == set(ea2.blocks)
    for got, want in zip(arrays(files.load(ea2)), arrays(kv_for(a2))):
        assert np.array_equal(got, want)


def test_a_write_in_flight_keeps_the_blocks_it_counts_on(tmp_path):
    files = KVFiles(tmp_path, 2**30, ["m"])
    a = np.arange(B + 50, dtype=np.int32)
    _, ea = write(files, a)
    longer = np.concatenate([a[:B], np.arange(300, dtype=np.int32)])
    staged = files.stage(MODEL, longer, len(longer), kv_for(longer))  # counts on `a`'s first block
    assert ea.blocks[0] not in staged.new_blocks
    files.delete([ea])  # meanwhile `a` goes (the budget, or a later turn)
    assert ea.blocks[0] in block_files(tmp_path)  # its first block stays: the write counts on it
    write_all(staged)
    entry = files.commit(staged)
    assert entry is not None and files.load(entry)[0].offset == len(longer)


def test_the_disk_budget_evicts_entries_and_frees_only_blocks_nobody_names(tmp_path):
    one = KVFiles(tmp_path / "probe", 2**30, ["m"])
    _, probe = write(one, np.arange(B, dtype=np.int32) + 10_000)
    files = KVFiles(tmp_path / "kv", int(3.5 * probe.nbytes), ["m"])  # room for 3 blocks and change
    base = np.arange(B, dtype=np.int32)
    _, first = write(files, np.concatenate([base, np.full(B, 1, np.int32)]))
    _, second = write(files, np.concatenate([base, np.full(B, 2, np.int32)]))  # shares block 0: 3 blocks in all
    assert files.count == 2 and files.block_count == 3
    _, third = write(files, np.concatenate([base, np.full(B, 3, np.int32)]))  # a 4th block: over the budget
    assert files.total_bytes <= files.budget_bytes
    assert [e.path for e in files.entries(MODEL)] == [second.path, third.path]  # the least recently used went
    assert block_files(tmp_path / "kv") == set(second.blocks) | set(third.blocks)  # block 0 stayed: still named


def test_a_scan_finds_the_entries_and_drops_what_a_kill_left(tmp_path):
    files = KVFiles(tmp_path, 2**30, ["m"])
    a = np.arange(B + 30, dtype=np.int32)
    _, prompt = write(files, a, conversation=("conv",))
    a2 = np.concatenate([a, np.arange(40, dtype=np.int32)])
    _, turn = write(files, a2, conversation=("conv",))  # the prompt's entry is not deleted: a kill came first
    orphan = files.stage(MODEL, np.full(B, 9, np.int32), B, kv_for(np.full(B, 9, np.int32)))
    for f in orphan.files[:-1]:  # its block reached disk, its manifest did not
        f.final.parent.mkdir(parents=True, exist_ok=True)
        f.final.write_bytes(f.header + b"".join(np.ascontiguousarray(p).tobytes() for p in f.parts))
    again = KVFiles(tmp_path, 2**30, ["m"])
    (kept,) = again.entries(MODEL)
    assert kept.path == turn.path and np.array_equal(kept.tokens, a2)  # the prompt's entry: superseded
    assert block_files(tmp_path) == set(turn.blocks)  # the orphan block and the prompt's partial one, gone
    assert json.loads(turn.path.read_text())["blocks"] == list(turn.blocks)
    assert not prompt.path.exists()
    assert KVFiles(tmp_path, 2**30, ["other"]).count == 0  # a model no longer configured: its entries go
    assert block_files(tmp_path) == set()


@pytest.mark.parametrize("quantized", [False, True])
def test_a_blocks_device_copy_writes_the_same_file_as_its_host_copy(tmp_path, quantized):
    """On a GPU a block is staged as the device's own copies, read to the
    host by the writer's thread (engine/cache/kv_blocks.py): the same bytes
    on disk as the CPU's numpy copies, bfloat16 and quantised alike, and the
    cache's buffers written past meanwhile change nothing in the file."""
    from mlxd.engine.cache.kv_blocks import stage_block
    from mlxd.engine.cache.kv_writer import write_file

    tokens = np.arange(B + 40, dtype=np.int32)
    kv = kv_for(tokens, quantized=quantized)
    files = {}
    for on_device in (False, True):
        staged = stage_block(tmp_path / f"{on_device}.safetensors", tmp_path / f"{on_device}.tmp", kv, (0, B),
                             {"model": MODEL}, on_device=on_device)
        assert all(isinstance(p, np.ndarray) != on_device for p in staged.parts)
        if on_device:  # the cache goes on: its buffers written over before the writer reads the copies
            for c in kv:
                if quantized:
                    c.keys = tuple(mx.zeros_like(a) for a in c.keys)
                else:
                    c.keys[..., :B, :] = mx.zeros_like(c.keys[..., :B, :])
            mx.eval([c.keys for c in kv])
        write_file(staged)
        files[on_device] = staged.final.read_bytes()
    assert files[True] == files[False] and len(files[True]) > B * 64


@pytest.mark.parametrize("quantized", [False, True])
def test_blocks_staged_together_write_the_files_each_staged_alone_writes(tmp_path, quantized):
    """A run of whole blocks is copied by one device op a buffer
    (kv_blocks.stage_blocks): every block's file the same bytes as the
    block staged by itself, and a partial last block and a gap before it
    staged as before."""
    from mlxd.engine.cache.kv_blocks import stage_block, stage_blocks
    from mlxd.engine.cache.kv_writer import write_file

    tokens = np.arange(4 * B + 40, dtype=np.int32)
    kv = kv_for(tokens, quantized=quantized)
    spans = [(0, B), (B, 2 * B), (2 * B, 3 * B), (4 * B, 4 * B + 40)]  # a run of three, a gap, a partial block
    together = stage_blocks([(tmp_path / f"t{i}.safetensors", tmp_path / f"t{i}.tmp") for i in range(4)], kv, spans,
                            {"model": MODEL}, on_device=True)
    alone = [stage_block(tmp_path / f"a{i}.safetensors", tmp_path / f"a{i}.tmp", kv, span, {"model": MODEL},
                         on_device=False) for i, span in enumerate(spans)]
    for t, a in zip(together, alone):
        write_file(t)
        write_file(a)
        assert t.final.read_bytes() == a.final.read_bytes() and t.nbytes == a.nbytes
