"""The embeddings' decisions as tables (pure, no model): the request's
inputs, the encoder's limits and forwards, the model a name means, the
vectors' size and the answer's formats; and the CPU path's kernels against
MLX's own."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from mlxd.config import Config
from mlxd.engine.api.embeddings_api import cut, embedding_model, embeddings_body, output_size
from mlxd.engine.api.request_schema import EmbeddingRequest
from mlxd.engine.model.errors import EngineError
from mlxd.engine.model.encoder import (LENGTH_BUCKET, encoder_limits, padded, plan_batches, token_problem,
                                       too_long)


@pytest.mark.parametrize("given, inputs", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
    ("bad \ud800 surrogate", ["bad \ufffd\ufffd\ufffd surrogate"]),  # clean_text: valid Unicode for the tokenizer
])
def test_the_inputs_of_a_request(given, inputs):
    assert EmbeddingRequest(model="e", input=given).inputs() == inputs


@pytest.mark.parametrize("config, st_config, tokenizer_max, limit, dims", [
    ({"model_type": "bert", "max_position_embeddings": 512, "hidden_size": 384}, {"max_seq_length": 256}, 512,
     256, 384),
    ({"model_type": "bert", "max_position_embeddings": 512, "hidden_size": 768}, None, 512, 512, 768),
    ({"model_type": "bert", "max_position_embeddings": 512, "hidden_size": 768}, None, 10**30, 512, 768),
    ({"model_type": "qwen3", "max_position_embeddings": 32768, "hidden_size": 1024}, {"max_seq_length": 8192},
     None, 8192, 1024),
])
def test_an_encoders_limits(config, st_config, tokenizer_max, limit, dims):
    got = encoder_limits(config, st_config, tokenizer_max)
    assert (got.max_tokens, got.dimensions) == (limit, dims)


@pytest.mark.parametrize("lengths, limit, refused", [
    ([3, 256], 256, None),
    ([3, 257], 256, 1),
    ([900, 3], 256, 0),
])
def test_an_input_over_the_limit_is_named(lengths, limit, refused):
    error = too_long(lengths, limit)
    if refused is None:
        assert error is None
    else:
        assert error.status == 400 and error.code == "context_length_exceeded" and f"input[{refused}]" in error.message


@pytest.mark.parametrize("lengths, heads, max_tokens, max_scores, batches", [
    ([5, 30, 7, 12], 1, 10_000, 10**9, [[1, 3, 2, 0]]),  # longest first, one forward
    ([5, 30, 7, 12], 1, 64, 10**9, [[1, 3], [2, 0]]),  # 2 rows of 32 padded tokens, then 2 of 8
    ([100] * 3, 1, 50, 10**9, [[0], [1], [2]]),  # a row over the bound still goes, alone
    ([64] * 4, 12, 10**6, 2 * 12 * 64 * 64, [[0, 1], [2, 3]]),  # the attention scores bound
    ([], 12, 100, 100, []),
])
def test_forwards_are_planned_by_length_within_bounds(lengths, heads, max_tokens, max_scores, batches):
    got = plan_batches(lengths, heads, max_tokens, max_scores)
    assert got == batches
    assert sorted(i for b in got for i in b) == list(range(len(lengths)))
    for b in got:
        width = padded(lengths[b[0]])
        assert width % LENGTH_BUCKET == 0 and all(lengths[i] <= width for i in b)
        assert len(b) == 1 or (len(b) * width <= max_tokens and len(b) * heads * width * width <= max_scores)


@pytest.mark.parametrize("ids, vocab, bad", [
    ([[0, 5, 9]], 10, None),
    ([[0, 10]], 10, 0),
    ([[1], [2, -1]], 10, 1),
])
def test_token_ids_outside_the_vocabulary(ids, vocab, bad):
    error = token_problem(ids, vocab)
    assert (error is None) if bad is None else (error.status == 400 and f"input[{bad}]" in error.message)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return Config.model_validate({"home": tmp_path, "models": {"chat": {"demo": "a"}}, "aliases": {"fast": "chat"},
                                  "embeddings": {"embedding": {"path": "/x"}, "mini": {"path": "/y"}}})


@pytest.mark.parametrize("name, status", [("embedding", None), ("mini", None), ("chat", 400), ("fast", 400),
                                          ("default", 400), ("nope", 404)])
def test_the_embedding_model_a_name_means(config, name, status):
    if status is None:
        assert embedding_model(config, name) == name
    else:
        with pytest.raises(EngineError) as refusal:
            embedding_model(config, name)
        assert refusal.value.status == status and "embedding, mini" in refusal.value.message


def test_an_embedding_id_may_not_be_a_chat_name(tmp_path):
    with pytest.raises(ValueError, match="also a model id or alias"):
        Config.model_validate({"home": tmp_path, "models": {"chat": {"demo": "a"}},
                               "embeddings": {"default": {"path": "/x"}}})


@pytest.mark.parametrize("requested, native, trained, size", [
    (None, 384, [], 384), (384, 384, [], 384), (128, 1024, [512, 256, 128], 128), (100, 384, [], None),
    (512, 384, [512], None), (64, 1024, [512, 256, 128], None),
])
def test_the_vectors_size(requested, native, trained, size):
    if size is None:
        with pytest.raises(EngineError) as refusal:
            output_size(requested, native, trained)
        assert refusal.value.param == "dimensions"
    else:
        assert output_size(requested, native, trained) == size


def test_cut_vectors_are_unit_length_and_point_the_same_way():
    raw = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    vectors = raw / np.linalg.norm(raw, axis=1, keepdims=True)  # a normalising model's
    got = cut(vectors, 8)
    assert got.shape == (3, 8) and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    assert np.allclose(got / got[:, :1], vectors[:, :8] / vectors[:, :1], atol=1e-5)
    assert cut(vectors, 16) is vectors
    kept = cut(raw, 8)  # a model without a Normalize module keeps its scale, as sentence-transformers' truncate_dim
    assert np.array_equal(kept, raw[:, :8])


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_the_answer_in_openais_shape(encoding):
    vectors = np.array([[0.5, -0.25], [1.0, 0.0]], dtype=np.float32)
    body = embeddings_body(vectors, encoding, "embedding", 7)
    assert body["object"] == "list" and body["model"] == "embedding"
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    for i, row in enumerate(body["data"]):
        assert row["object"] == "embedding" and row["index"] == i
        got = row["embedding"] if encoding == "float" else np.frombuffer(base64.b64decode(row["embedding"]), "<f4")
        assert np.array_equal(np.asarray(got, dtype=np.float32), vectors[i])


def test_the_cpu_kernels_match_mlxs_own():
    import mlx.core as mx
    import mlx.nn as nn

    from mlxd.engine.cpu.cpu_encoder import fast_exp, fast_gelu, fast_softmax

    x = mx.array(np.linspace(-12, 12, 4001, dtype=np.float32)).reshape(1, 4001)
    assert mx.max(mx.abs(fast_gelu(x) - nn.gelu(x))).item() < 2e-6
    z = mx.array(np.linspace(-80, 0, 4001, dtype=np.float32))
    assert mx.max(mx.abs(fast_exp(z) - mx.exp(z)) / mx.exp(z)).item() < 1e-5
    scores = mx.array(np.random.default_rng(1).normal(scale=8, size=(2, 3, 5, 7)).astype(np.float32))
    assert mx.allclose(fast_softmax(scores), mx.softmax(scores, axis=-1), atol=1e-6).item()


@pytest.mark.parametrize("fetched", [True, False])
def test_the_default_embedding_model_is_there_once_fetched(tmp_path, fetched):
    from mlxd.config_schema import default_embeddings

    folder = tmp_path / "all-MiniLM-L6-v2"
    folder.mkdir()
    if fetched:
        (folder / "model.safetensors").write_bytes(b"x")
    got = default_embeddings(folder)
    assert (got["embedding"].path, got["embedding"].ollama) == (str(folder), "all-minilm") if fetched else got == {}
