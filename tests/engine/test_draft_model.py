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

from mlxd.engine.model.draft_model import DraftModel, common_prefix, same_vocabulary
from mlxd.engine.model.row_proposals import DraftProposer
from tiny_models import batch_decode, greedy, tiny_llama


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
    from mlxd.engine.model.row_attention import route_attention

    route_attention()  # as the runner does at load: several rows' attention row by row
    return tiny_llama(tied=True), tiny_llama(tied=True, intermediate=64)  # same vocabulary, other weights


@pytest.mark.parametrize("draft_is", ["the model itself", "another model"])
def test_the_draft_decodes_greedy_decodings_tokens(models, draft_is):
    model, other = models
    draft = DraftModel("d", model if draft_is == "the model itself" else other)
    prompt = [(5 * j + 3) % 97 for j in range(24)]
    expected = greedy(model, prompt, 30)

    def proposer(p, kv):
        return DraftProposer(draft, draft.take(p[:-1]), p[:-1], 3)

    (out,), (stats,), _ = batch_decode(model, [prompt], 30, proposer)
    assert out == expected
    assert stats.mode == "draft" and stats.tokens == 30 and stats.forwards <= 30 and stats.accepted <= stats.proposed
    if draft_is == "the model itself":  # every proposal accepted: 4 tokens a forward
        assert stats.accepted == stats.proposed and stats.forwards <= 30 // 4 + 2
    assert not draft.taken  # the row ended: its draft KV is back for the next request


def test_one_row_holds_the_draft_at_a_time_and_the_others_decode_plain(models):
    model, _ = models
    draft = DraftModel("d", model)
    prompts = [[(5 * j + 3 + r) % 97 for j in range(20 + 5 * r)] for r in range(3)]
    proposers = []

    def proposer(p, kv):
        taken = draft.take(p[:-1])
        proposers.append(taken is not None)
        return DraftProposer(draft, taken, p[:-1], 3) if taken is not None else None

    out, stats, _ = batch_decode(model, prompts, 20, proposer, verify_together=True)
    assert proposers == [True, False, False]  # the draft's one KV (one allowance in the memory estimate)
    assert out == [greedy(model, p, 20) for p in prompts]
    assert stats[0].accepted > 0 and stats[1] is None and stats[2] is None


def test_the_drafts_kv_of_one_request_serves_the_next_ones_common_prefix(models):
    model, _ = models
    draft = DraftModel("d", model)
    first = list(range(10, 60))
    kv = draft.take(first)
    assert kv[0].offset == 50 and draft.take(first) is None  # one row holds it
    model(mx.array([[7, 8, 9]]), cache=kv)  # the row's answer ran through the draft
    draft.put_back(kv, first + [7, 8, 9])
    second = first + [7, 8, 9, 70, 71]  # the next turn: the first's prompt and answer, and more
    assert draft.take(second) is kv and kv[0].offset == len(second)
    draft.put_back(kv, second)
    third = first[:20] + [90] * 5  # another conversation sharing 20 tokens: cut back, the rest prefilled
    assert draft.take(third)[0].offset == 25
    # The KV cut back and prefilled is the KV of `third` computed afresh: the next logits agree.
    fresh = make_prompt_cache(model)
    a = model(mx.array([[5]]), cache=kv)
    model(mx.array([third]), cache=fresh)
    b = model(mx.array([[5]]), cache=fresh)
    assert mx.allclose(a, b, atol=1e-4).item()
    draft.put_back(kv, [1, 2])  # not what it holds: started over
    assert draft.take([1, 2, 3])[0].offset == 3


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
