"""The rerankers' decisions as tables (engine/model/rerank_decisions.py, pure):
the results' order, a cross-encoder's activation and pair limit, cosine
scores, a chat model's yes/no score; and the gateway's refusal before LiteLLM."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlxd.engine.model.rerank_decisions import (IDENTITY, activation, chat_messages, cosine_scores, pair_limit,
                                                ranked, yes_probability)


@pytest.mark.parametrize("scores, top_n, order", [
    ([0.1, 0.9, 0.5], None, [1, 2, 0]),
    ([0.1, 0.9, 0.5], 2, [1, 2]),
    ([0.1, 0.9, 0.5], 10, [1, 2, 0]),
    ([0.5, 0.5, 0.7], None, [2, 0, 1]),  # ties keep the documents' order
    ([-1.0, -3.0], None, [0, 1]),
    ([0.2], 1, [0]),
])
def test_ranked(scores, top_n, order):
    assert ranked(scores, top_n) == order


@pytest.mark.parametrize("config, expected", [
    ({}, "Sigmoid"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, "Sigmoid"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, IDENTITY),
    ({"sentence_transformers": {}}, "Sigmoid"),
])
def test_activation(config, expected):
    assert activation(config) == expected


@pytest.mark.parametrize("config, tokenizer_max, limit", [
    ({"model_type": "bert", "max_position_embeddings": 512}, 512, 512),
    ({"model_type": "bert", "max_position_embeddings": 512}, None, 512),
    ({"model_type": "bert", "max_position_embeddings": 512}, 10**30, 512),  # transformers' "no limit" sentinel
    ({"model_type": "bert", "max_position_embeddings": 512}, 128, 128),
    ({"model_type": "xlm-roberta", "max_position_embeddings": 514}, None, 512),
    ({"model_type": "xlm-roberta", "max_position_embeddings": 8194}, 8192, 8192),
])
def test_pair_limit(config, tokenizer_max, limit):
    assert pair_limit(config, tokenizer_max) == limit


def test_cosine_scores():
    vectors = np.array([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [1.0, 1.0]])
    got = cosine_scores(vectors)
    assert got[:3] == [1.0, 0.0, -1.0] and math.isclose(got[3], math.sqrt(0.5))


@pytest.mark.parametrize("yes, no, p", [(0.0, 0.0, 0.5), (2.0, 0.0, 1 / (1 + math.exp(-2))), (-30.0, 30.0, 0.0)])
def test_yes_probability(yes, no, p):
    assert math.isclose(yes_probability(yes, no), p, abs_tol=1e-12)


def test_chat_messages_carry_the_instruction_query_and_document():
    system, user = chat_messages("Find it", "the query", "the doc")
    assert system["role"] == "system" and '"yes" or "no"' in system["content"]
    assert user["content"] == "<Instruct>: Find it\n<Query>: the query\n<Document>: the doc"


@pytest.mark.parametrize("body, status, param", [
    (b"", 400, None),
    (b"[1]", 400, None),
    (b'{"model": "reranker", "query": "q", "documents": []}', 400, "documents"),
    (b'{"model": "reranker", "query": "q"}', 400, "documents"),
    (b'{"model": "default", "query": "q", "documents": ["a"]}', 400, "model"),
    (b'{"model": "enc", "query": "q", "documents": ["a"]}', 400, "model"),
    (b'{"model": "nope", "query": "q", "documents": ["a"]}', 404, "model"),
    (b'{"model": "reranker", "query": "q", "documents": ["a", {"text": "b"}]}', None, None),
])
def test_the_gateway_refuses_before_litellm(tmp_path, body, status, param):
    from mlxd.config import parse_config
    from mlxd.gateway.rerank import rerank_refusal

    config = parse_config({"models": {"demo-a": {"demo": "a"}}, "embeddings": {"enc": {"path": str(tmp_path)}}},
                          tmp_path)
    assert list(config.rerankers) == ["reranker"]  # the default: the first embedding model's vectors
    refusal = rerank_refusal(body, config)
    assert (refusal.status if refusal else None) == status
    if refusal is not None:
        assert refusal.param == param and refusal.message
