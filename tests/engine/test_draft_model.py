"""Speculative decoding by a draft model (engine/model/draft_model.py): its
decisions as tables, its tokens against mlx-lm's greedy decoding in process
(tiny random-weight llamas), and in the running engine over HTTP: the same
answers as without it, /metrics counting what it proposed, a draft of another
tokenizer refused at load with the engine still up."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
import requests
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.model.draft_model import DraftModel, common_prefix, draft_steps, same_vocabulary
from mlxd.engine.model.speculative import SpecStats
from tiny_models import greedy, tiny_llama


@pytest.mark.parametrize("a, b, n", [([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2), ([], [1], 0),
                                     ([5], [6], 0), ([1, 2, 3], [1, 2, 3], 3)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n


@pytest.mark.parametrize("draft_vocab, refused", [
    ({"a": 0, "b": 1, "c": 2}, False),
    ({"a": 0, "b": 2, "c": 1}, True),     # the same tokens under other ids: a proposed id would mean other text
    ({"a": 0, "b": 1}, True),             # fewer tokens
    ({"a": 0, "b": 1, "c": 2, "d": 3}, True),
])
def test_a_draft_must_give_every_token_the_models_id(draft_vocab, refused):
    why = same_vocabulary({"a": 0, "b": 1, "c": 2}, draft_vocab)
    assert (why is not None) is refused
    if refused:
        assert "tokenizer differs" in why


@pytest.fixture(scope="module")
def models():
    return tiny_llama(tied=True), tiny_llama(tied=True, intermediate=64)  # same vocabulary, other weights


@pytest.mark.parametrize("draft_is", ["the model itself", "another model"])
def test_the_draft_decodes_greedy_decodings_tokens(models, draft_is):
    model, other = models
    draft = DraftModel("d", model if draft_is == "the model itself" else other)
    prompt = [(5 * j + 3) % 97 for j in range(24)]
    expected = greedy(model, prompt, 30)
    kv = make_prompt_cache(model)
    model(mx.array([prompt[:-1]], dtype=mx.int32), cache=kv)
    stats = SpecStats(mode="draft")
    out = [t for t, _ in draft_steps(model, kv, draft, prompt[-1:], prompt[:-1], 30, None, 3, stats)]
    assert out == expected
    assert stats.tokens == 30 and stats.forwards <= 30 and stats.accepted <= stats.proposed
    if draft_is == "the model itself":  # every proposal accepted: 4 tokens a forward
        assert stats.accepted == stats.proposed and stats.forwards <= 30 // 4 + 1


def test_the_drafts_kv_of_one_request_serves_the_next_ones_common_prefix(models):
    model, _ = models
    draft = DraftModel("d", model)
    first = list(range(10, 60))
    kv = draft.kv_for(first)
    assert kv[0].offset == 50
    draft.ended(first + [7, 8, 9])  # its answer: the KV holds what the request ran through the draft
    second = first + [7, 8, 9, 70, 71]  # the next turn: the first's prompt and answer, and more
    assert draft.kv_for(second) is kv and kv[0].offset == len(second)
    third = first[:20] + [90] * 5  # another conversation sharing 20 tokens: cut back, the rest prefilled
    assert draft.kv_for(third)[0].offset == 25
    # The KV cut back and prefilled is the KV of `third` computed afresh: the next logits agree.
    fresh = make_prompt_cache(model)
    a = model(mx.array([[5]]), cache=draft.kv_for(third))
    model(mx.array([third]), cache=fresh)
    b = model(mx.array([[5]]), cache=fresh)
    assert mx.allclose(a, b, atol=1e-4).item()


# --- in the running engine -------------------------------------------------------------
PROMPT = "Rewrite this line exactly: the quick brown fox jumps over the lazy dog. " * 4


def spec_metrics(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    return {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("mlxd_engine_spec_")}


def ask(url: str, model: str, max_tokens: int = 24, **extra) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": PROMPT}], **extra})


def foreign_tokenizer_copy(model: Path, folder: Path) -> Path:
    """The model's folder with two tokens' ids swapped in its tokenizer: same weights, another tokenizer."""
    folder.mkdir()
    for f in model.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "tokenizer.json").unlink()
    tok = json.loads((model / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [t for t in vocab if len(t) > 1][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


@pytest.mark.timeout(180)
def test_a_draft_model_answers_as_plain_decoding_does_and_a_foreign_one_is_refused(
        start_engine, demo_models, tmp_path):
    from conftest import engine_toml

    foreign = foreign_tokenizer_copy(demo_models.a, tmp_path / "foreign")
    extra = {"drafted": {"path": demo_models.a, "draft": "demo-a-copy", "draft_tokens": 4},
             "demo-a-copy": {"path": demo_models.a},
             "foreign": {"path": foreign},
             "mismatched": {"path": demo_models.a, "draft": "foreign"}}
    ep = start_engine(toml=engine_toml(demo_models, {"max_tokens_cap": 64}, extra))
    assert ask(ep.url, "drafted", 1).status_code == 200
    assert requests.get(ep.url + "/health", timeout=10).json()["serving"]["speculative"] == "draft"
    plain = [ask(ep.url, "demo-a", n).json()["choices"][0]["message"]["content"] for n in (5, 40)]
    before = spec_metrics(ep.url)
    drafted = [ask(ep.url, "drafted", n).json()["choices"][0]["message"]["content"] for n in (5, 40)]
    assert drafted == plain  # its draft is the same model: every proposal accepted, the same tokens
    after = spec_metrics(ep.url)
    assert after["mlxd_engine_spec_requests"] - before["mlxd_engine_spec_requests"] == 2
    accepted = after["mlxd_engine_spec_accepted"] - before["mlxd_engine_spec_accepted"]
    forwards = after["mlxd_engine_spec_forwards"] - before["mlxd_engine_spec_forwards"]
    assert accepted > 0 and forwards < 45  # several tokens a forward
    r = ask(ep.url, "mismatched")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "model_load_failed" and "tokenizer differs" in err["message"], err
    assert ask(ep.url, "demo-a", 5).json()["choices"][0]["message"]["content"] == plain[0]  # still up
