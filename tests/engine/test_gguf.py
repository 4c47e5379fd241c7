"""GGUF models: converted once into an MLX folder that is the same model,
served by a real engine, refused clearly when MLX cannot serve them, and
never left half-converted by a kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.devkit.gguf_fixture import write_gguf, write_header_only
from mlxd.engine.model.errors import EngineError
from mlxd.engine.model.gguf_convert import cached_model_dir, convert_gguf, quantization_config
from mlxd.toml_text import dumps
from testkit import chat, wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def demo_gguf(demo_models, tmp_path_factory) -> Path:
    return write_gguf(demo_models.a, tmp_path_factory.mktemp("gguf") / "demo-a.gguf")


def _logits(model_dir: Path, rope_traditional: bool | None = None):
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tok = load(str(model_dir))
    if rope_traditional is not None:
        for layer in model.model.layers:
            layer.self_attn.rope.traditional = rope_traditional
    ids = mx.array([tok.encode("The quick brown fox jumps over the lazy dog, again and again")])
    return model(ids)


def test_a_converted_gguf_is_the_same_model(demo_gguf, demo_models, tmp_path):
    import mlx.core as mx

    folder = convert_gguf(demo_gguf, tmp_path / "cache")
    assert folder == cached_model_dir(demo_gguf, tmp_path / "cache")
    original, converted = _logits(demo_models.a), _logits(folder)
    assert mx.abs(original - converted).max().item() < 1e-3
    # the control: without interleaved RoPE the permuted q/k rows give another model
    assert mx.abs(original - _logits(folder, rope_traditional=False)).max().item() > 1e-2
    assert convert_gguf(demo_gguf, tmp_path / "cache") == folder  # cached: not converted again


def test_mixed_bit_widths_become_per_module_quantization():
    import mlx.core as mx

    arrays = {"a.weight": mx.zeros((8, 16), mx.uint32), "a.scales": mx.zeros((8, 4)),   # 4 bits
              "b.weight": mx.zeros((8, 32), mx.uint32), "b.scales": mx.zeros((8, 4)),   # 8 bits
              "c.weight": mx.zeros((8, 16), mx.uint32), "c.scales": mx.zeros((8, 4)),   # 4 bits
              "norm.weight": mx.zeros((8,))}
    assert quantization_config(arrays) == {"group_size": 32, "bits": 4, "b": {"group_size": 32, "bits": 8}}
    assert quantization_config({"norm.weight": mx.zeros((8,))}) is None


def test_an_unsupported_gguf_is_a_400_naming_the_type(tmp_path):
    bad = write_header_only(tmp_path / "k-quant.gguf", "llama", {"blk.0.attn_q.weight": 14})
    with pytest.raises(EngineError) as info:
        convert_gguf(bad, tmp_path / "cache")
    assert info.value.status == 400 and info.value.code == "model_unsupported" and "Q6_K" in info.value.message
    assert not (tmp_path / "cache").exists()


def engine_toml(demo_models, demo_gguf: Path, unsupported: Path) -> str:
    return dumps({"models": {"gguf-a": {"gguf": demo_gguf}, "demo-a": {"path": demo_models.a},
                             "k-quant": {"gguf": unsupported}},
                  "aliases": {"default": "gguf-a"}})


def test_the_engine_serves_a_gguf_as_it_serves_the_original(start_engine, demo_models, demo_gguf, tmp_path):
    unsupported = write_header_only(tmp_path / "k-quant.gguf", "llama", {"blk.0.attn_q.weight": 14})
    eng = start_engine(toml=engine_toml(demo_models, demo_gguf, unsupported))
    assert eng.health()["resident_model"] == "gguf-a"  # preloaded: converted at start
    assert list((eng.home / "models" / "gguf").glob("demo-a-*/model.safetensors"))
    from_gguf = chat(eng.url, "gguf-a", "hello there", max_tokens=12)
    from_folder = chat(eng.url, "demo-a", "hello there", max_tokens=12)
    assert from_gguf.status_code == from_folder.status_code == 200
    text = lambda r: r.json()["choices"][0]["message"]["content"]  # noqa: E731
    assert text(from_gguf) == text(from_folder) and text(from_gguf)

    refused = chat(eng.url, "k-quant", "hello")
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["code"] == "model_unsupported" and "Q6_K" in err["message"]
    assert eng.proc.poll() is None and eng.health()["status"] == "ok"  # the engine stays up
    assert chat(eng.url, "gguf-a", "again").status_code == 200


CONVERT = """
import sys
from pathlib import Path
from mlxd.engine.model.gguf_convert import convert_gguf
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def _kill_mid_conversion(gguf_path: Path, cache: Path) -> Path | None:
    """Start a conversion and SIGKILL it once its temp folder exists; the
    temp folder, or None when the conversion won the race and finished."""
    proc = subprocess.Popen([sys.executable, "-c", CONVERT, str(gguf_path), str(cache)])
    try:
        tmp = wait_until(lambda: next(iter(cache.glob(".*.tmp")), None) or proc.poll() is not None, 60,
                         interval=0.001, what="the conversion's temp folder")
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        proc.kill()
        proc.wait()
    return tmp if isinstance(tmp, Path) and tmp.exists() else None


def test_a_kill_9_during_conversion_leaves_no_model_that_looks_whole(demo_gguf, tmp_path):
    for attempt in range(5):  # the conversion takes milliseconds: the kill may come after it
        cache = tmp_path / f"cache{attempt}"
        tmp = _kill_mid_conversion(demo_gguf, cache)
        if tmp is not None:
            break
    else:
        pytest.fail("5 conversions finished before the kill could land")
    target = cached_model_dir(demo_gguf, cache)
    assert not target.exists(), "a killed conversion left the final folder"
    assert convert_gguf(demo_gguf, cache) == target and (target / "config.json").is_file()
    assert not list(cache.glob(".*.tmp")), "the next conversion removes a dead one's temp folder"


def test_the_engine_serves_an_ollama_model_from_ollamas_store(start_engine, demo_models, demo_gguf, tmp_path):
    from mlxd.devkit.gguf_fixture import write_ollama_store

    write_ollama_store(tmp_path / "ollama", "demo:tiny", demo_gguf)
    toml = dumps({"models": {"from-ollama": {"from_ollama": "demo:tiny"}, "demo-a": {"path": demo_models.a},
                             "not-pulled": {"from_ollama": "nothing:here"}},
                  "aliases": {"default": "from-ollama"}})
    eng = start_engine(toml=toml, env={"OLLAMA_MODELS": str(tmp_path / "ollama")})
    same = [chat(eng.url, m, "hello there", max_tokens=12).json()["choices"][0]["message"]["content"]
            for m in ("from-ollama", "demo-a")]
    assert same[0] == same[1] and same[0]
    missing = chat(eng.url, "not-pulled", "hello")
    assert missing.status_code == 503 and "ollama pull nothing:here" in missing.json()["error"]["message"]
    assert eng.proc.poll() is None


def test_a_qwen3_gguf_converts_to_the_same_model(demo_models, tmp_path):
    """qwen3: q/k norms, a head_dim of its own, tied embeddings, no permuted rows."""
    import mlx.core as mx

    from mlxd.devkit.gguf_fixture import qwen3_from_demo

    original = qwen3_from_demo(demo_models.a, tmp_path / "qwen3")
    folder = convert_gguf(write_gguf(original, tmp_path / "qwen3.gguf"), tmp_path / "cache")
    assert mx.abs(_logits(original) - _logits(folder)).max().item() < 1e-2  # float16 weights


def test_an_f16_gguf_keeps_its_dtype(demo_models, tmp_path):
    import mlx.core as mx

    from mlxd.devkit.gguf_fixture import qwen3_from_demo

    folder = convert_gguf(write_gguf(qwen3_from_demo(demo_models.a, tmp_path / "q"), tmp_path / "q.gguf"),
                          tmp_path / "cache")
    weights = mx.load(str(folder / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float16
