"""/v1/rerank through the whole service with the clients users point at it:
Cohere's own SDK (`ClientV2`, its /v2/rerank) and `litellm.rerank` (its
Cohere provider, /v1/rerank), against the gateway's key, LiteLLM's rerank
route and the engine's default reranker (the real default embedding
model's vectors). The relevant document first in every hand-written set
(tests/rerank_sets.py); bad input refused before LiteLLM; with the engine
down, a 503 that says there is no fallback (Ollama has no rerank API), and
the Ollama stand-in never asked."""

from __future__ import annotations

import cohere
import litellm
import pytest
import requests

from mlxd.devkit.ollama_standin import start_standin
from mlxd.supervisor.control import rpc
from mlxd.toml_text import dumps, table_lines
from rerank_sets import RANKING_SETS
from testkit import real_embedding_model, wait_until

pytestmark = pytest.mark.timeout(300)
OLLAMA_CHAT = "llama3.2:3b"


@pytest.fixture(scope="module")
def ollama():
    with start_standin(models=(OLLAMA_CHAT, "all-minilm")) as standin:  # stopped by pid at the end
        yield standin


@pytest.fixture(scope="module")
def st(module_stack, ollama):
    folder = real_embedding_model()  # no [rerankers]: `reranker` is the first embedding model's vectors
    return module_stack(gateway=table_lines({"ollama_url": ollama.url, "default_ollama_model": OLLAMA_CHAT}),
                        models=dumps({"embeddings": {"embedding": {"path": folder}}}))


def asked(ollama) -> dict:
    """What the Ollama stand-in was asked, but for these reads of it."""
    return {k: v for k, v in ollama.stats()["requests"].items() if k != "GET /_standin/stats"}


def auth(st) -> dict:
    return {"Authorization": f"Bearer {st.key}"}


def test_cohere_sdk_puts_the_relevant_document_first_in_every_set(st, ollama):
    before = asked(ollama)
    co = cohere.ClientV2(base_url=st.gateway_url, api_key=st.key, timeout=60)
    for query, documents, relevant in RANKING_SETS:
        answer = co.rerank(model="reranker", query=query, documents=documents, top_n=2)
        assert len(answer.results) == 2 and answer.results[0].index == relevant, (query, answer.results)
        assert answer.results[0].relevance_score >= answer.results[1].relevance_score
    assert asked(ollama) == before  # nothing went to Ollama


def test_litellm_rerank_puts_the_relevant_document_first_in_every_set(st):
    for query, documents, relevant in RANKING_SETS:
        answer = litellm.rerank(model="cohere/reranker", api_base=st.gateway_url, api_key=st.key, query=query,
                                documents=documents, return_documents=True)
        results = answer.results
        assert results[0]["index"] == relevant, (query, results)
        assert results[0]["document"]["text"] == documents[relevant]
        assert len(results) == len(documents)


def test_without_the_key_it_is_401(st):
    resp = requests.post(st.gateway_url + "/v1/rerank", json={"model": "reranker", "query": "q", "documents": ["a"]},
                         timeout=30)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("body, status, param", [
    ({"model": "reranker", "query": "q", "documents": []}, 400, "documents"),
    ({"model": "reranker", "query": "", "documents": ["a"]}, 400, "query"),
    ({"model": "reranker", "query": "q", "documents": [{"title": "no text"}]}, 400, "documents"),
    ({"model": "default", "query": "q", "documents": ["a"]}, 400, "model"),
    ({"model": "embedding", "query": "q", "documents": ["a"]}, 400, "model"),
    ({"model": "nope", "query": "q", "documents": ["a"]}, 404, "model"),
    ({"model": "reranker", "query": "q", "documents": ["a"], "instruction": "x"}, 400, "instruction"),  # the engine's
])
def test_bad_input_is_a_clear_error_at_the_gateway(st, body, status, param):
    resp = requests.post(st.gateway_url + "/v1/rerank", json=body, headers=auth(st), timeout=60)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


def test_with_the_engine_down_a_503_says_there_is_no_fallback(st, ollama):
    before = asked(ollama)
    rpc(st.paths).supervisor.stopProcess("engine", True)
    try:
        for path in ("/v1/rerank", "/v2/rerank"):
            resp = requests.post(st.gateway_url + path, headers=auth(st), timeout=60,
                                 json={"model": "reranker", "query": "q", "documents": ["a", "b"]})
            assert resp.status_code == 503, resp.text
            error = resp.json()["error"]
            assert error["code"] == "engine_unavailable" and "Ollama has no rerank" in error["message"]
            assert int(resp.headers["retry-after"]) > 0
        assert asked(ollama) == before
    finally:
        rpc(st.paths).supervisor.startProcess("engine", False)
    wait_until(st.healthy, 60, what="the engine back")
    resp = requests.post(st.gateway_url + "/v1/rerank", headers=auth(st), timeout=60,
                         json={"model": "reranker", "query": "capital of France", "documents": ["Paris", "Cheese"]})
    assert resp.status_code == 200 and resp.json()["results"][0]["index"] == 0
