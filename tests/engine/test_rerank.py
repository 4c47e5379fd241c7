"""POST /v1/rerank on a real engine: the default reranker (the real default
embedding model's vectors) puts the relevant document first in every
hand-written set (tests/rerank_sets.py) and its scores are the cosines of
/v1/embeddings' own vectors; the three paths answer alike; a chat model
ranks by its yes/no logits; bad input is a clear 400/404; counted."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from mlxd.toml_text import dumps
from rerank_sets import RANKING_SETS
from testkit import real_embedding_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, demo_models):
    from testkit import spawn_engine, wait_healthy

    from mlxd.devkit import tiny_encoders

    folder = real_embedding_model()
    home = tmp_path_factory.mktemp("rerank")
    cross = tiny_encoders.build("bert-cross-encoder", home / "cross", folder)
    toml = dumps({"engine": {"keep_alive": "-1"},
                  "models": {"demo-a": {"path": demo_models.a}},
                  "aliases": {"default": "demo-a"},
                  "embeddings": {"embedding": {"path": folder}},
                  "rerankers": {"reranker": {"embedding": "embedding"}, "judge": {"chat_model": "default"},
                                "cross": {"path": str(cross)}}})
    ep = spawn_engine(home, toml)
    try:
        wait_healthy(ep)
        yield ep
    finally:
        ep.stop()


def rerank(ep, path: str = "/v1/rerank", **body) -> requests.Response:
    return requests.post(ep.url + path, json={"model": "reranker", **body}, timeout=120)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("query, documents, relevant", RANKING_SETS, ids=[q[:30] for q, _, _ in RANKING_SETS])
def test_the_relevant_document_comes_first(engine, query, documents, relevant):
    resp = rerank(engine, query=query, documents=documents)
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    assert [r["index"] for r in results][0] == relevant, results
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and sorted(r["index"] for r in results) == list(range(len(documents)))


def test_scores_are_the_cosines_of_the_embeddings(engine):
    query, documents, _ = RANKING_SETS[0]
    got = rerank(engine, query=query, documents=documents).json()["results"]
    vectors = requests.post(engine.url + "/v1/embeddings", json={"model": "embedding", "input": [query, *documents]},
                            timeout=60).json()["data"]
    for r in got:
        assert abs(r["relevance_score"] - cosine(vectors[0]["embedding"], vectors[1 + r["index"]]["embedding"])) < 1e-5


def test_top_n_documents_objects_and_every_path(engine):
    query, documents, relevant = RANKING_SETS[3]
    whole = rerank(engine, query=query, documents=documents).json()
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        resp = rerank(engine, path, query=query, documents=[{"text": d, "title": "x"} for d in documents], top_n=2,
                      return_documents=True)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert [r["index"] for r in body["results"]] == [r["index"] for r in whole["results"]][:2]
        assert body["results"][0]["document"] == {"text": documents[relevant]}
        assert body["id"].startswith("rerank-") and body["model"] == "reranker"
        assert body["usage"]["prompt_tokens"] == body["meta"]["tokens"]["input_tokens"] > 0
    assert "document" not in whole["results"][0]


def test_max_tokens_per_doc_cuts_a_document(engine):
    query = "What is the capital of France?"
    long_doc = "Paris is the capital of France. " + "Unrelated filler about gardening and soil. " * 40
    full = rerank(engine, query=query, documents=[long_doc]).json()["results"][0]["relevance_score"]
    cut = rerank(engine, query=query, documents=[long_doc], max_tokens_per_doc=8).json()["results"][0]
    assert cut["relevance_score"] > full + 0.05  # only its first sentence read: all on the subject


def test_a_cross_encoder_scores_as_sentence_transformers_and_stays_resident(engine):
    """The tiny cross-encoder's scores over HTTP are sentence-transformers' CrossEncoder's on the same weights
    (tests/engine/data/rerank_reference.json, bench/rerank_reference.py)."""
    import json
    from pathlib import Path

    reference = json.loads((Path(__file__).parent / "data" / "rerank_reference.json").read_text())
    for entry in reference["kinds"]["bert-cross-encoder"]["sets"][:5]:
        resp = rerank(engine, model="cross", query=entry["query"], documents=entry["documents"])
        assert resp.status_code == 200, resp.text
        got = {r["index"]: r["relevance_score"] for r in resp.json()["results"]}
        assert max(abs(got[i] - s) for i, s in enumerate(entry["scores"])) < 1e-4
    health = requests.get(engine.url + "/health", timeout=5).json()
    assert health["reranker_model"] == "cross" and health["embedding_model"] == "embedding"  # both beside the chat


def test_a_chat_model_ranks_by_its_yes_and_no(engine):
    query, documents, _ = RANKING_SETS[0]
    resp = rerank(engine, model="judge", query=query, documents=documents, instruction="Find the capital")
    assert resp.status_code == 200, resp.text
    scores = [r["relevance_score"] for r in resp.json()["results"]]
    assert len(scores) == 3 and all(0 < s < 1 for s in scores) and scores == sorted(scores, reverse=True)
    again = rerank(engine, model="judge", query=query, documents=documents, instruction="Find the capital").json()
    assert again["results"] == resp.json()["results"]  # greedy logits: the same every time
    other = rerank(engine, model="judge", query=query, documents=documents).json()  # the configured instruction
    assert [r["relevance_score"] for r in other["results"]] != scores


@pytest.mark.parametrize("body, status, param", [
    ({"query": "", "documents": ["a"]}, 400, "query"),
    ({"query": "q", "documents": []}, 400, "documents"),
    ({"query": "q", "documents": [{"title": "no text"}]}, 400, "documents"),
    ({"query": "q", "documents": [3]}, 400, "documents"),
    ({"query": "q", "documents": ["a"] * 1001}, 400, "documents"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n"),
    ({"query": "q", "documents": ["a"], "instruction": "be brief"}, 400, "instruction"),
    ({"model": "default", "query": "q", "documents": ["a"]}, 400, "model"),
    ({"model": "embedding", "query": "q", "documents": ["a"]}, 400, "model"),
    ({"model": "nope", "query": "q", "documents": ["a"]}, 404, "model"),
])
def test_bad_input_is_a_clear_error(engine, body, status, param):
    resp = rerank(engine, **body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert requests.get(engine.url + "/health", timeout=5).status_code == 200


def test_counted_in_health_and_metrics(engine):
    before = requests.get(engine.url + "/health", timeout=5).json()["counters"]
    query, documents, _ = RANKING_SETS[5]
    assert rerank(engine, query=query, documents=documents).status_code == 200
    after = requests.get(engine.url + "/health", timeout=5).json()["counters"]
    assert after["rerank_requests"] == before["rerank_requests"] + 1
    assert after["rerank_documents"] == before["rerank_documents"] + len(documents)
    assert after["rerank_tokens"] > before["rerank_tokens"]
    metrics = requests.get(engine.url + "/metrics", timeout=5).text
    assert f"mlxd_engine_rerank_requests {float(after['rerank_requests'])}" in metrics
