"""The prompt cache's writer (engine/cache/kv_writer.py): the file it stages is
what mlx-lm's save_prompt_cache writes, array for array and every
metadata string (mlx-lm reads it back
with load_prompt_cache), and its thread reports a failed write instead of
raising. The engine-level promise (a slow disk holds up no request) is
tests/engine/test_prompt_cache.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.engine.model.faults import FaultInjector, parse_faults
from mlxd.engine.cache.kv_writer import KVWriter, StagedWrite, safetensors_header, stage_file, write_file


def caches(kind: str) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    mx.random.seed(0)
    kv = mx.random.normal((1, 2, 40, 64))
    if kind == "bfloat16, a slice of a longer buffer":  # KVCache allocates in steps of 256: its state is a slice
        c = KVCache()
        c.update_and_fetch(kv.astype(mx.bfloat16), kv.astype(mx.bfloat16))
        return [c, c]
    if kind == "float32, rotating window":
        c = RotatingKVCache(max_size=16)
        c.update_and_fetch(kv, kv)
        return [c]
    c = QuantizedKVCache(group_size=32, bits=4)
    c.update_and_fetch(kv, kv)
    return [c]


@pytest.mark.parametrize("kind", ["bfloat16, a slice of a longer buffer", "float32, rotating window",
                                  "4-bit quantised"])
def test_the_staged_file_is_mlx_lms_own(tmp_path: Path, kind: str):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    cache, meta = caches(kind), {"model": "m@1", "tokens": "AAAA"}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    staged = stage_file(ours, tmp_path / "tmp" / "x.safetensors", cache, meta)
    write_file(staged)
    save_prompt_cache(str(theirs), cache, meta)
    import mlx.core as mx

    (a, a_meta), (b, b_meta) = (mx.load(str(f), return_metadata=True) for f in (ours, theirs))
    assert a_meta == b_meta and sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and mx.array_equal(a[k], b[k]).item() for k in a)
    assert staged.nbytes == ours.stat().st_size and not (tmp_path / "tmp" / "x.safetensors").exists()
    back, back_meta = load_prompt_cache(str(ours), return_metadata=True)
    assert back_meta == meta and [type(c) for c in back] == [type(c) for c in cache]
    assert [c.offset for c in back] == [c.offset for c in cache]


def test_the_header_is_padded_to_8_bytes():
    header = safetensors_header([("a", "F32", (2, 3), 24), ("b", "BF16", (1,), 2)], {"k": "v"})
    n = int.from_bytes(header[:8], "little")
    assert n == len(header) - 8 and n % 8 == 0 and header[8:].rstrip(b" ").endswith(b"}")


def test_a_failed_write_is_reported_not_raised(tmp_path: Path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")  # the temporary file's folder cannot be made under a file
    writer = KVWriter()
    good = stage_file(tmp_path / "good.safetensors", tmp_path / "tmp" / "g.safetensors",
                      caches("float32, rotating window"), {})
    bad = stage_file(tmp_path / "bad.safetensors", blocker / "tmp" / "b.safetensors",
                     caches("float32, rotating window"), {})
    writer.submit(StagedWrite([bad]))
    writer.submit(StagedWrite([good]))
    done = []
    while writer.pending:
        done += writer.finished(block=True, timeout=30)
    writer.close()
    assert [d.files[0].final.name for d in done] == ["bad.safetensors", "good.safetensors"]  # in order
    assert done[0].error and done[1].error is None and (tmp_path / "good.safetensors").exists()


@pytest.mark.parametrize("spec, ok", [("slow@kv_write:200", True), ("slow@prefill:5", True), ("slow@token:3", False),
                                      ("abort@prefill", False), ("abort@kv_write", True)])
def test_slow_goes_with_prefill_and_kv_write(spec, ok):
    if ok:
        assert parse_faults(spec)
    else:
        with pytest.raises(ValueError):
            parse_faults(spec)


def test_a_slow_disk_delays_the_write_not_the_prefill():
    faults = FaultInjector("slow@kv_write:1000", None)
    assert faults.prefill_delay_s(100) == 0.0
    assert FaultInjector("slow@prefill:10", None).prefill_delay_s(100) == pytest.approx(1.0)
