"""/v1/embeddings through the whole service: the gateway's key, the engine's
encoder (the real default embedding model), and the Ollama stand-in's
/api/embed (Ollama's real API) when the engine is down; the openai client."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import requests

from mlxd.devkit.ollama_standin import EMBED_DIMENSIONS, start_standin
from mlxd.supervisor.control import rpc
from mlxd.toml_text import dumps, table_lines
from testkit import real_embedding_model, wait_until

pytestmark = pytest.mark.timeout(300)
OLLAMA_CHAT, OLLAMA_EMBED = "llama3.2:3b", "all-minilm"


@pytest.fixture(scope="module")
def ollama():
    with start_standin(models=(OLLAMA_CHAT, OLLAMA_EMBED)) as standin:  # stopped by pid at the end
        yield standin


@pytest.fixture(scope="module")
def st(module_stack, ollama):
    folder = real_embedding_model()
    return module_stack(gateway=table_lines({"ollama_url": ollama.url, "default_ollama_model": OLLAMA_CHAT}),
                        models=dumps({"embeddings": {"embedding": {"path": folder, "ollama": OLLAMA_EMBED}}}))


@pytest.fixture
def client(st) -> openai.OpenAI:
    return openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=st.key, max_retries=0, timeout=60)


def cosine(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_engine_embeds_through_the_gateway(client, st, ollama):
    before = ollama.stats()["embed_requests"]
    answer = client.embeddings.create(model="embedding", input=["a cat sat on the mat", "a kitten on a rug",
                                                                "quarterly tax filing deadlines"])
    cat, kitten, tax = (d.embedding for d in answer.data)
    assert len(cat) == 384 and answer.model == "embedding"
    assert cosine(cat, kitten) > cosine(cat, tax) + 0.2  # a real model's vectors, not a stand-in's hashes
    floats = requests.post(st.gateway_url + "/v1/embeddings", timeout=60, headers={"Authorization": f"Bearer {st.key}"},
                           json={"model": "embedding", "input": "a cat sat on the mat"})
    assert floats.status_code == 200 and cosine(floats.json()["data"][0]["embedding"], cat) > 0.99999
    assert ollama.stats()["embed_requests"] == before
    assert requests.get(st.url + "/health", timeout=5).json()["counters"]["embedding_requests"] == 2


def test_without_the_key_it_is_401(st):
    resp = requests.post(st.gateway_url + "/v1/embeddings", json={"model": "embedding", "input": "x"}, timeout=30)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"model": "default", "input": "x"}, "model"),
    ("/v1/chat/completions", {"model": "embedding", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("/v1/embeddings", {"model": "embedding", "input": []}, "input"),
    ("/v1/embeddings", {"model": "embedding", "input": "word " * 300}, "input"),
])
def test_a_mistaken_request_is_a_clear_400_and_ollama_is_not_asked(st, ollama, path, body, param):
    before = ollama.stats()["embed_requests"]
    resp = requests.post(st.gateway_url + path, json=body, headers={"Authorization": f"Bearer {st.key}"}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert ollama.stats()["embed_requests"] == before


def test_ollamas_twin_answers_while_the_engine_is_down(client, st, ollama):
    before = ollama.stats()["embed_requests"]
    rpc(st.paths).supervisor.stopProcess("engine", True)
    try:
        answer = client.embeddings.create(model="embedding", input=["while the engine is down", "and more"])
        assert len(answer.data) == 2 and len(answer.data[0].embedding) == EMBED_DIMENSIONS
        assert ollama.stats()["embed_requests"] == before + 1
        assert ollama.stats()["last_request"]["model"] == OLLAMA_EMBED
    finally:
        rpc(st.paths).supervisor.startProcess("engine", False)
    wait_until(st.healthy, 60, what="the engine back")
    client.embeddings.create(model="embedding", input="back")
    assert ollama.stats()["embed_requests"] == before + 1  # the engine again at once
