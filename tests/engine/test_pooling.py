"""The encoder's vectors are sentence-transformers' (issue 53): pooling and
normalisation read from the folder's own files (engine/model/encoder.py's
`pooling_plan`), checked as a table, then each pooling on a tiny
random-weight folder (mlxd.devkit.tiny_encoders) in process against
sentence-transformers' vectors on the same weights
(tests/engine/data/pooling_reference.json, written by
bench/pooling_reference.py): cosine >= 0.9999 and the same norms (unit only
where modules.json has Normalize; a folder with no sentence-transformers
files is normalised, by mlxd's choice)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlxd.devkit import tiny_encoders
from mlxd.engine.model.encoder import PoolingPlan, pooling_mode, pooling_plan

REFERENCE = json.loads((Path(__file__).parent / "data" / "pooling_reference.json").read_text(encoding="utf-8"))

ST = "sentence_transformers.models."
TRANSFORMER, POOLING, NORMALIZE, DENSE = ({"type": ST + name} for name in ("Transformer", "Pooling", "Normalize",
                                                                            "Dense"))
BERT = {"architectures": ["BertModel"], "model_type": "bert"}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
LEGACY_MEAN = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}

PLANS = [  # modules.json, 1_Pooling/config.json, config.json -> (mode, normalize)
    ([TRANSFORMER, POOLING, NORMALIZE], LEGACY_MEAN, BERT, ("mean", True)),  # all-MiniLM-L6-v2
    ([TRANSFORMER, POOLING], {"pooling_mode_cls_token": True}, BERT, ("cls", False)),
    ([TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode_lasttoken": True}, QWEN3, ("lasttoken", True)),
    ([TRANSFORMER, POOLING], {"pooling_mode": "max"}, BERT, ("max", False)),  # sentence-transformers 3+'s key
    ([TRANSFORMER, POOLING], {"pooling_mode": ["weightedmean"]}, BERT, ("weightedmean", False)),
    ([TRANSFORMER, POOLING], {"pooling_mode_mean_sqrt_len_tokens": True}, BERT, ("mean_sqrt_len_tokens", False)),
    ([TRANSFORMER, POOLING], {}, BERT, ("mean", False)),  # no flag set: sentence-transformers' mean
    ([{"type": "sentence_transformers.base.modules.normalize.Normalize"}, TRANSFORMER, POOLING], LEGACY_MEAN, BERT,
     ("mean", True)),  # a module's full path: its class name counts
    (None, None, BERT, ("mean", True)),  # no sentence-transformers files: its default pooling, normalised
    (None, None, QWEN3, ("lasttoken", True)),  # ... a causal LM's last token
    (None, None, {**QWEN3, "is_causal": False}, ("mean", True)),  # ... unless it attends both ways
    (None, None, {}, ("mean", True)),
    (None, {"pooling_mode_cls_token": True}, BERT, ("cls", True)),  # a 1_Pooling/ without modules.json
    ([TRANSFORMER, NORMALIZE], None, QWEN3, ("lasttoken", True)),  # no Pooling module: the default pooling
    ([TRANSFORMER, POOLING, DENSE, DENSE, NORMALIZE], LEGACY_MEAN, {"model_type": "gemma3_text"}, (None, True)),
]


@pytest.mark.parametrize("modules,pooling,config,expected", PLANS)
def test_the_pooling_plan_is_sentence_transformers(modules, pooling, config, expected):
    plan = pooling_plan(modules, pooling, config)
    assert isinstance(plan, PoolingPlan) and (plan.mode, plan.normalize) == expected
    assert plan.why


@pytest.mark.parametrize("pooling", [{"pooling_mode": ["cls", "mean"]}, {"pooling_mode": "sum"},
                                     {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}])
def test_a_pooling_mlxd_cannot_do_is_refused_at_load(pooling):
    with pytest.raises(ValueError, match="pooling"):
        pooling_mode(pooling)


def test_the_reference_covers_every_kind():
    assert set(REFERENCE["kinds"]) == set(tiny_encoders.KINDS)


@pytest.fixture(scope="module")
def minilm() -> Path:
    from testkit import real_embedding_model

    return real_embedding_model()  # BERT's vocabulary


def run_encoder(folder: Path, texts: list[str]) -> tuple[list[list[int]], np.ndarray]:
    from mlxd.engine.model.encoder import Encoder

    enc = Encoder("x", folder)
    ids = enc.tokenize(texts, truncate=False)
    run = enc.start(ids)
    while not run.step():
        pass
    return ids, run.vectors()


@pytest.mark.parametrize("kind", sorted(tiny_encoders.KINDS))
def test_the_vectors_are_sentence_transformers(kind, tmp_path, minilm):
    spec, ref = tiny_encoders.KINDS[kind], REFERENCE["kinds"][kind]
    folder = tiny_encoders.build(kind, tmp_path / kind, minilm)
    assert tiny_encoders.weights_sha256(folder) == ref["weights_sha256"], (
        "the builder's weights changed: run bench/pooling_reference.py again (its docstring says how)")
    ids, got = run_encoder(folder, ref["texts"])
    assert ids == ref["token_ids"], "the tokenizer splits differently from sentence-transformers'"
    want = np.asarray(ref["vectors"], dtype=np.float64)
    assert got.shape == want.shape
    got = got.astype(np.float64)
    cosines = np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.9999, cosines
    # Unit where modules.json has Normalize, sentence-transformers' own norms where it has not; a folder
    # without sentence-transformers files is normalised (sentence-transformers' fallback is not).
    unit = spec.normalize or spec.pooling is None
    want_norms = np.ones(len(want)) if unit else np.linalg.norm(want, axis=1)
    if spec.normalize:
        assert np.allclose(np.linalg.norm(want, axis=1), 1.0, rtol=1e-4)
    else:
        assert not np.allclose(np.linalg.norm(want, axis=1), 1.0, rtol=1e-2)  # the kind tells norms apart
    assert np.allclose(np.linalg.norm(got, axis=1), want_norms, rtol=1e-3), (np.linalg.norm(got, axis=1),
                                                                             want_norms)


def test_the_builder_is_small_and_quick(tmp_path, minilm):
    import time

    for kind in tiny_encoders.KINDS:
        started = time.monotonic()
        folder = tiny_encoders.build(kind, tmp_path / kind, minilm)
        assert time.monotonic() - started < 2.0
        assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) < 2 * 2**20
        assert (folder / "modules.json").is_file() == (tiny_encoders.KINDS[kind].pooling is not None)
