"""POST /v1/embeddings on a real engine with the real default embedding
model (all-MiniLM-L6-v2, fetched by set-up): the same vectors as
sentence-transformers on the same weights (tests/engine/data/, written by
bench/embeddings.py --write-reference), OpenAI's request shapes and answer
formats, the model's limits as clear 400s, served between a chat answer's
steps, counted, and given back with the chat model when idle."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from mlxd.toml_text import dumps
from testkit import metric, real_embedding_model, wait_until

pytestmark = pytest.mark.timeout(300)
REFERENCE = json.loads((Path(__file__).parent / "data" / "minilm_reference.json").read_text())


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def engine(tmp_path_factory, demo_models):
    from testkit import spawn_engine, wait_healthy

    folder = real_embedding_model()
    home = tmp_path_factory.mktemp("embeddings")
    toml = dumps({"engine": {"keep_alive": "-1"},
                  "models": {"demo-a": {"path": demo_models.a}},
                  "aliases": {"default": "demo-a"},
                  "embeddings": {"embedding": {"path": folder},
                                 "cut": {"path": folder, "dimensions": [128, 64]}}})
    ep = spawn_engine(home, toml)
    try:
        wait_healthy(ep)
        yield ep
    finally:
        ep.stop()


def post(ep, **body) -> requests.Response:
    return requests.post(ep.url + "/v1/embeddings", json={"model": "embedding", **body}, timeout=120)


def vectors(resp: requests.Response) -> list[list[float]]:
    assert resp.status_code == 200, resp.text
    data = resp.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return [d["embedding"] for d in data]


def test_the_vectors_are_sentence_transformers_own(engine):
    got = vectors(post(engine, input=REFERENCE["texts"], truncate=True))
    sims = [cosine(g, r) for g, r in zip(got, REFERENCE["vectors"])]
    assert min(sims) >= 0.999, sims
    assert all(abs(np.linalg.norm(g) - 1) < 1e-4 for g in got)  # unit length, as the model's Normalize module


def test_a_batch_gives_each_input_what_it_gets_alone(engine):
    texts = REFERENCE["texts"][:5]
    together = vectors(post(engine, input=texts))
    for text, vector in zip(texts, together):
        assert cosine(vectors(post(engine, input=text))[0], vector) > 0.99999  # padding changes nothing


def test_base64_and_token_ids_and_the_openai_client(engine):
    text = REFERENCE["texts"][0]
    floats = vectors(post(engine, input=text))[0]
    raw = vectors(post(engine, input=[text], encoding_format="base64"))[0]
    assert np.allclose(np.frombuffer(base64.b64decode(raw), dtype="<f4"), floats, atol=1e-6)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(real_embedding_model()))(text)["input_ids"]
    by_ids = post(engine, input=ids)
    assert cosine(vectors(by_ids)[0], floats) > 0.99999 and by_ids.json()["usage"]["prompt_tokens"] == len(ids)
    assert cosine(vectors(post(engine, input=[ids, ids]))[1], floats) > 0.99999
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(model="embedding", input=[text, "another"])  # the SDK asks for base64
    assert cosine(answer.data[0].embedding, floats) > 0.99999 and len(answer.data) == 2
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(ids)


def test_dimensions_where_the_model_allows_them(engine):
    full = np.array(vectors(post(engine, model="cut", input="memory of the agent"))[0])
    cut = np.array(vectors(post(engine, model="cut", input="memory of the agent", dimensions=128))[0])
    assert cut.shape == (128,) and abs(np.linalg.norm(cut) - 1) < 1e-5
    assert cosine(cut, full[:128]) > 0.99999
    assert len(vectors(post(engine, model="cut", input="x", dimensions=384))[0]) == 384
    refused = post(engine, input="x", dimensions=128)  # `embedding` lists no smaller sizes
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
    assert "384" in refused.json()["error"]["message"]


@pytest.mark.parametrize("body, status, param, code", [
    ({"input": "word " * 300}, 400, "input", "context_length_exceeded"),
    ({"input": ["ok", "word " * 300]}, 400, "input", "context_length_exceeded"),
    ({"input": []}, 400, "input", "invalid_request"),
    ({"input": ""}, 400, "input", "invalid_request"),
    ({"input": [[]]}, 400, "input", "invalid_request"),
    ({"input": [[101, 10**9, 102]]}, 400, "input", "invalid_request"),
    ({"input": [[101, -1, 102]]}, 400, "input", "invalid_request"),
    ({"input": ["a"] * 2049}, 400, "input", "invalid_request"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format", "invalid_request"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions", "invalid_request"),
    ({"input": "x", "model": "demo-a"}, 400, "model", "invalid_request"),
    ({"input": "x", "model": "default"}, 400, "model", "invalid_request"),
    ({"input": "x", "model": "no-such-encoder"}, 404, "model", "model_not_found"),
    ({"input": {"text": "x"}}, 400, "input", "invalid_request"),
], ids=["too-long", "one-too-long", "empty-list", "empty-string", "empty-ids", "foreign-id", "negative-id",
        "too-many", "format", "zero-dims", "chat-model", "chat-alias", "unknown", "object"])
def test_bad_input_is_a_clear_openai_error_and_the_engine_stays_up(engine, body, status, param, code):
    resp = post(engine, **body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert requests.get(engine.url + "/health", timeout=5).json()["status"] == "ok"


def test_truncate_cuts_to_the_models_limit(engine):
    long = "word " * 300
    resp = post(engine, input=long, truncate=True)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == 256


def test_embeddings_are_served_between_a_chat_answers_steps(engine):
    """An agent's memory lookup does not wait for another request's whole answer."""
    first_chunk, ended = threading.Event(), []

    def long_answer() -> None:
        with requests.post(engine.url + "/v1/chat/completions", stream=True, timeout=120, json={
                "model": "default", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000,
                "temperature": 0, "stream": True, "ignore_eos": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data: {"):
                    first_chunk.set()
        ended.append(time.monotonic())

    chat = threading.Thread(target=long_answer)
    chat.start()
    try:
        assert first_chunk.wait(60)
        assert len(vectors(post(engine, input=["while the chat decodes", "and another"]))) == 2
        answered = time.monotonic()
        assert not ended, "the embedding request waited for the chat answer's end"
    finally:
        chat.join(120)
    assert ended and ended[0] > answered


def test_counted_in_health_and_metrics(engine):
    before = metric(engine.url, "mlxd_engine_embedding_inputs")
    post(engine, input=["one", "two", "three"])
    assert metric(engine.url, "mlxd_engine_embedding_inputs") == before + 3
    health = requests.get(engine.url + "/health", timeout=5).json()
    assert health["embedding_model"] in ("embedding", "cut")
    assert health["counters"]["embedding_requests"] >= 1


def test_given_back_with_the_chat_model_when_idle(tmp_path, demo_models):
    from testkit import spawn_engine, wait_healthy

    folder = real_embedding_model()
    toml = dumps({"engine": {"keep_alive": "1s"}, "models": {"demo-a": {"path": demo_models.a}},
                  "embeddings": {"embedding": {"path": folder}}})
    ep = spawn_engine(tmp_path, toml)
    try:
        wait_healthy(ep)
        health = lambda: requests.get(ep.url + "/health", timeout=5).json()  # noqa: E731
        assert len(vectors(post(ep, input="remember this"))[0]) == 384
        wait_until(lambda: health()["embedding_model"] is None and health()["resident_model"] is None, 30,
                   what="the idle unload")
        assert health()["counters"]["idle_unloads"] >= 1
        assert len(vectors(post(ep, input="and this", keep_alive=-1))[0]) == 384  # loaded again
        assert health()["embedding_model"] == "embedding"
    finally:
        ep.stop()
