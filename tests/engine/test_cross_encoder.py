"""Rerank scores are sentence-transformers' (issue 53: Spearman >= 0.99
against its CrossEncoder on the same model and inputs), in process, no
server: each tiny random-weight cross-encoder of mlxd.devkit.tiny_encoders
(CROSS_KINDS: BERT with the default Sigmoid, with Identity named where
sentence-transformers 4-5 and 6 write it, XLM-R) through
engine/model/reranker.py's `CrossEncoder`, and the default reranker (the
real all-MiniLM-L6-v2's cosine) through the encoder's `CosineRun`, over
tests/rerank_sets.py's sets and long ones the tokenizers cut, against
tests/engine/data/rerank_reference.json (written by
bench/rerank_reference.py): the same token ids, the same order in every
set, Spearman >= 0.99 over all pairs pooled, and the same numbers (1e-4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlxd.devkit import tiny_encoders
from mlxd.engine.model.rerank_decisions import IDENTITY, RerankWork, activation
from rerank_sets import RANKING_SETS

REFERENCE = json.loads((Path(__file__).parent / "data" / "rerank_reference.json").read_text(encoding="utf-8"))
MINILM = "minilm-cosine"
TOLERANCE = 1e-4  # absolute on sigmoid scores and cosines; relative (to max(1, |logit|)) on raw logits


def spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def test_the_reference_covers_every_kind_and_set():
    assert set(REFERENCE["kinds"]) == set(tiny_encoders.CROSS_KINDS) | {MINILM}
    for entry in REFERENCE["kinds"].values():
        sets = [(s["query"], s["documents"]) for s in entry["sets"]]
        assert sets[:len(RANKING_SETS)] == [(q, docs) for q, docs, _ in RANKING_SETS]
        assert len(sets) > len(RANKING_SETS)  # and long ones
    for kind in tiny_encoders.CROSS_KINDS:  # the long ones are cut at the tokenizer's limit
        entry = REFERENCE["kinds"][kind]
        lengths = [len(row) for s in entry["sets"] for row in s["token_ids"]]
        assert max(lengths) == entry["max_seq_length"] == tiny_encoders.CROSS_MAX_LENGTH
        assert sum(n == entry["max_seq_length"] for n in lengths) >= 3


ST = "sentence_transformers"
IDENTITY_FN, SIGMOID_FN = "torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Sigmoid"


@pytest.mark.parametrize("config, st_config, expected", [
    ({}, None, "Sigmoid"),
    ({ST: {"activation_fn": IDENTITY_FN, "version": "5.1.1"}}, None, IDENTITY),  # sentence-transformers 4-5
    ({ST: {"activation_fn": SIGMOID_FN}}, None, "Sigmoid"),
    ({"sbert_ce_default_activation_function": IDENTITY_FN}, None, IDENTITY),  # before 4
    ({}, {"activation_fn": IDENTITY_FN, "model_type": "CrossEncoder"}, IDENTITY),  # 6
    ({ST: {"activation_fn": IDENTITY_FN}}, {"activation_fn": SIGMOID_FN}, "Sigmoid"),  # 6's file first
    ({ST: {"activation_fn": IDENTITY_FN}}, {"activation_fn": None}, IDENTITY),
    ({}, {"model_type": "CrossEncoder"}, "Sigmoid"),
    ({ST: {"activation_fn": "my_package.Identity"}}, None, "Sigmoid"),  # not torch's: not loaded, the default
    ({ST: {"activation_fn": IDENTITY_FN}}, {"activation_fn": "my_package.Sigmoid"}, IDENTITY),
    ({ST: {"activation_fn": None}, "sbert_ce_default_activation_function": IDENTITY_FN}, None, "Sigmoid"),
])
def test_the_activation_is_read_as_sentence_transformers_reads_it(config, st_config, expected):
    assert activation(config, st_config) == expected


@pytest.mark.parametrize("kind", sorted(tiny_encoders.CROSS_KINDS))
def test_each_folders_activation_is_read_as_sentence_transformers_did(kind, tmp_path, minilm):
    folder = tiny_encoders.build(kind, tmp_path / kind, minilm)
    st_path = folder / "config_sentence_transformers.json"
    st_config = json.loads(st_path.read_text()) if st_path.is_file() else None
    assert activation(json.loads((folder / "config.json").read_text()), st_config) == REFERENCE["kinds"][kind][
        "activation"]


@pytest.fixture(scope="module")
def minilm() -> Path:
    from testkit import real_embedding_model

    return real_embedding_model()  # BERT's vocabulary, and the default reranker's model


def compare(entry: dict, got_sets: list[list[float]], relative: bool) -> tuple[float, float]:
    """Per-set order, pooled Spearman, closeness; (pooled Spearman, max abs difference)."""
    for one, got in zip(entry["sets"], got_sets, strict=True):
        assert len(got) == len(one["scores"])
        assert spearman(got, one["scores"]) >= 0.99, (one["query"], got, one["scores"])
    got = np.concatenate([np.asarray(g, dtype=np.float64) for g in got_sets])
    want = np.concatenate([np.asarray(s["scores"], dtype=np.float64) for s in entry["sets"]])
    rho = spearman(got, want)
    assert rho >= 0.99, rho
    diff = np.abs(got - want)
    scale = np.maximum(1.0, np.abs(want)) if relative else 1.0
    assert (diff / scale).max() <= TOLERANCE, (diff.max(), int(diff.argmax()))
    assert np.ptp(want) > (5.0 if relative else 0.5)  # the scores are spread, not all alike
    return rho, float(diff.max())


@pytest.mark.parametrize("kind", sorted(tiny_encoders.CROSS_KINDS))
def test_cross_encoder_scores_are_sentence_transformers(kind, tmp_path, minilm):
    from mlxd.engine.model.reranker import CrossEncoder

    entry = REFERENCE["kinds"][kind]
    folder = tiny_encoders.build(kind, tmp_path / kind, minilm)
    assert tiny_encoders.weights_sha256(folder) == entry["sha256"], (
        "the builder's weights changed: run bench/rerank_reference.py again (its docstring says how)")
    encoder = CrossEncoder("x", folder)
    assert encoder.max_tokens == entry["max_seq_length"]
    got_sets = []
    for one in entry["sets"]:
        run = encoder.start(RerankWork(one["query"], one["documents"]))
        assert run.ids == one["token_ids"], "the pairs are tokenised or cut differently from sentence-transformers'"
        while not run.step():
            pass
        got_sets.append(run.scores())
    assert encoder.activation == entry["activation"]
    compare(entry, got_sets, relative=entry["activation"] == IDENTITY)


def test_the_default_rerankers_cosines_are_sentence_transformers(minilm):
    from mlxd.engine.model.encoder import Encoder
    from mlxd.engine.model.reranker import CosineRun

    entry = REFERENCE["kinds"][MINILM]
    assert tiny_encoders.weights_sha256(minilm) == entry["sha256"], "another all-MiniLM-L6-v2"
    encoder = Encoder("embedding", minilm)
    got_sets = []
    for one in entry["sets"]:
        run = CosineRun(encoder.start(encoder.tokenize([one["query"], *one["documents"]], truncate=True)))
        while not run.step():  # as engine/model/runner.py's start_rerank
            pass
        got_sets.append(run.scores())
    compare(entry, got_sets, relative=False)
