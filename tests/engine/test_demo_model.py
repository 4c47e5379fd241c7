"""Tests of the self-built demo models (mlxd.engine.model.demo_model)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.engine.model import demo_model
from mlxd.engine.model.demo_model import (
    STAMP,
    VARIANTS,
    build_demo_model,
    write_heavy_model_description,
)

UNICODE = "héllo wörld 你好 🙂"

pytestmark = pytest.mark.integration  # builds models, some in other processes


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo") / "a")


@pytest.fixture(scope="module")
def loaded(built):
    from mlx_lm.utils import load

    return load(str(built))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_build_loads_and_generates_greedily_to_max_tokens(loaded):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True)
    assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in tokenizer.eos_token_ids
    # EOS logit is pinned at exactly 0 (its lm_head row is zero), the others are not
    assert not model.lm_head.weight[eos].any().item()
    assert model.lm_head.weight[eos + 1].any().item()

    def run():
        out = list(stream_generate(model, tokenizer, prompt, max_tokens=48,
                                   sampler=make_sampler(temp=0.0)))
        return [r.token for r in out], out[-1].finish_reason

    tokens, reason = run()
    assert len(tokens) == 48 and reason == "length"  # never stopped early on EOS
    assert eos not in tokens
    assert len(set(tokens)) > 1
    assert run()[0] == tokens  # greedy decoding is deterministic


def test_same_variant_builds_byte_identical_and_variants_differ(tmp_path, built):
    again = build_demo_model(tmp_path / "again", "a")
    first, second = _files(built), _files(again)
    assert first.keys() == second.keys()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert first[name] == second[name], name

    b = build_demo_model(tmp_path / "b", "b")
    a_bytes = (built / "model.safetensors").stat().st_size
    b_bytes = (b / "model.safetensors").stat().st_size
    assert b_bytes >= 2 * a_bytes
    assert VARIANTS["a"].seed != VARIANTS["b"].seed
    assert json.loads((b / STAMP).read_text())["variant"] == "b"


def test_tokenizer_training_is_deterministic_across_processes(tmp_path):
    # Rust hash maps are seeded per process, so train in a fresh interpreter.
    code = ("import sys; from mlxd.engine.model.demo_model import _train_tokenizer; "
            "_train_tokenizer(1024).save(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.json")], check=True)
    ours = tmp_path / "ours.json"
    demo_model._train_tokenizer(1024).save(str(ours))
    assert (tmp_path / "t.json").read_bytes() == ours.read_bytes()


def test_second_call_on_complete_folder_does_not_rebuild(built):
    weights = built / "model.safetensors"
    before = (weights.stat().st_ino, weights.stat().st_mtime_ns,
              (built / STAMP).stat().st_mtime_ns)
    messages: list[str] = []
    assert build_demo_model(built, "a", progress=messages.append) == built
    assert messages == []
    after = (weights.stat().st_ino, weights.stat().st_mtime_ns,
             (built / STAMP).stat().st_mtime_ns)
    assert after == before


def test_unstamped_folder_is_rebuilt_and_dead_partials_removed(tmp_path, built):
    dest = tmp_path / "a"
    dest.mkdir()
    (dest / "config.json").write_text("{}")  # a half build: no stamp, no weights
    (dest / "model.safetensors").write_bytes(b"truncated")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    partial = tmp_path / f".a.{int(dead.stdout)}.deadbeef.tmp"
    partial.mkdir()
    messages: list[str] = []
    build_demo_model(dest, "a", progress=messages.append)
    assert any("tokenizer" in m for m in messages)
    assert any("weights" in m for m in messages)
    assert (dest / STAMP).is_file()
    assert (dest / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    assert not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp folders left


def test_other_variant_replaces_build_but_foreign_folder_is_refused(tmp_path):
    dest = build_demo_model(tmp_path / "m", "a")
    build_demo_model(dest, "b")
    assert json.loads((dest / STAMP).read_text())["variant"] == "b"

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        build_demo_model(foreign, "a")
    assert (foreign / "notes.txt").read_text() == "precious"
    with pytest.raises(KeyError):
        build_demo_model(tmp_path / "x", "no-such-variant")


def test_concurrent_builders_do_not_corrupt_each_other(tmp_path, built):
    dest = tmp_path / "shared"
    code = "import sys; from mlxd.engine.model.demo_model import build_demo_model; build_demo_model(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(dest)],
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert _files(dest) == _files(built)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]


def test_chat_template_renders_roles_tools_and_rejects_unknown_role(loaded):
    import jinja2

    _, tokenizer = loaded
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "c1", "type": "function",
            # mlx_lm.server turns the arguments string into a dict before rendering
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools,
                                         add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|begin_of_text|><|im_start|>system\nYou are terse.")
    assert text.count("<|im_start|>system") == 1  # tools merged into the system turn
    assert '"name": "get_weather"' in text and '"description": "Weather for a city"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert "<|im_start|>tool\n21 C, sunny<|im_end|>\n" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")

    plain = tokenizer.apply_chat_template(messages[1:2], tokenize=False)
    assert "<tools>" not in plain and not plain.endswith("<|im_start|>assistant\n")
    assert tokenizer.has_tool_calling  # mlx-lm recognises the <tool_call> format

    with pytest.raises(jinja2.TemplateError, match="unknown message role 'wizard'"):
        tokenizer.apply_chat_template([{"role": "wizard", "content": "hi"}], tokenize=False)


def test_unicode_round_trips(loaded):
    _, tokenizer = loaded
    ids = tokenizer.encode(UNICODE, add_special_tokens=False)
    assert tokenizer.decode(ids) == UNICODE
    assert len(ids) < len(UNICODE.encode("utf-8"))  # merges were learned for it
    assert tokenizer.encode("hi")[0] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")


def _llama_params(c: dict) -> int:
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    head_dim = hidden // c["num_attention_heads"]
    attention = 2 * hidden * hidden + 2 * hidden * c["num_key_value_heads"] * head_dim
    mlp = 3 * hidden * c["intermediate_size"]
    lm_head = 0 if c.get("tie_word_embeddings") else vocab * hidden
    return vocab * hidden + c["num_hidden_layers"] * (attention + mlp) + lm_head


@pytest.mark.parametrize("billions", [70, 8, 405])
def test_heavy_description_is_config_only_and_about_that_big(tmp_path, billions):
    dest = write_heavy_model_description(tmp_path / "heavy", params_billion=billions)
    assert [p.name for p in dest.iterdir()] == ["config.json"]
    config = json.loads((dest / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization" not in config
    assert abs(_llama_params(config) - billions * 1e9) <= 0.1 * billions * 1e9


def test_heavy_description_quantized_and_loadable_config(tmp_path):
    dest = write_heavy_model_description(tmp_path / "q", quant_bits=4)
    config = json.loads((dest / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4}
    assert config["hidden_size"] == 8192 and config["num_key_value_heads"] == 8
    from mlx_lm.models import llama

    llama.ModelArgs.from_dict(config)  # the config is a valid mlx-lm llama config
    from mlx_lm.utils import load

    with pytest.raises(FileNotFoundError):  # no weights: it can never really load
        load(str(dest))


def test_builder_that_loses_the_race_keeps_the_winners_build(tmp_path, monkeypatch):
    dest = tmp_path / "raced"
    original = demo_model._build_into
    calls, winner = [], []

    def build_then_lose(folder, variant, spec, say):
        original(folder, variant, spec, say)
        calls.append(folder)
        if len(calls) == 1:  # another builder completes dest before we rename
            build_demo_model(dest, variant)
            winner.append((dest / "model.safetensors").stat().st_ino)

    monkeypatch.setattr(demo_model, "_build_into", build_then_lose)
    build_demo_model(dest, "a")
    assert len(calls) == 2
    (winner_inode,) = winner
    assert (dest / "model.safetensors").stat().st_ino == winner_inode  # ours discarded
    assert (dest / STAMP).is_file()
    assert build_demo_model(dest, "a") == dest
    assert (dest / "model.safetensors").stat().st_ino == winner_inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raced"]


def test_failed_build_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(demo_model, "_write_weights", crash)
    with pytest.raises(OSError, match="disk full"):
        build_demo_model(tmp_path / "a", "a")
    assert list(tmp_path.iterdir()) == []


def test_benchmark_sizes_have_real_shapes_and_padded_vocab_is_never_picked(tmp_path, monkeypatch):
    """The big benchmark variants: "8b" is Llama 3.1 8B's shape exactly; a padded
    model vocab (rows past the tokenizer's) is zero in lm_head, so greedy decoding
    only emits tokens the tokenizer can decode. Checked on a small spec that takes
    the same mx.random path as the big ones (threshold lowered)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    assert {"c", "8b"} <= set(VARIANTS)
    s = VARIANTS["8b"]
    assert (s.hidden_size, s.num_hidden_layers, s.intermediate_size, s.num_attention_heads,
            s.num_key_value_heads, s.model_vocab_size, s.dtype) == (4096, 32, 14336, 32, 8, 128256, "bfloat16")
    spec = demo_model.DemoSpec(128, 2, 256, 4, 2, 1024, 99, 2048, "bfloat16", model_vocab_size=4096)
    monkeypatch.setitem(VARIANTS, "tiny-padded", spec)
    monkeypatch.setattr(demo_model, "_NUMPY_MAX_PARAMS", 0)
    folder = build_demo_model(tmp_path / "padded", "tiny-padded")
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 4096
    model, tokenizer = load(str(folder))
    head = model.lm_head.weight
    assert head.shape == (4096, 128) and str(head.dtype) == "mlx.core.bfloat16"
    assert not head[1024:].any().item() and head[1023].any().item()
    out = list(stream_generate(model, tokenizer, "padded vocab", max_tokens=64, sampler=make_sampler(temp=0.0)))
    assert len(out) == 64 and all(r.token < 1024 for r in out)
