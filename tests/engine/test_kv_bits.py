"""kv_bits in a real engine process: a quantised KV cache answers, is
reported in /health, counts at its quantised size in admission (a request
that does not fit at 16 bits fits at 8), and its prompt-cache entries are
kept quantised, in memory and on disk, and never reused under another
kv_bits."""

from __future__ import annotations

import json

import pytest
import requests

from mlxd.toml_text import dumps
from testkit import engine_in, prompt_ids, settled_health, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SYSTEM = "You are a careful assistant for the mlxd project. " * 30  # ~300 tokens


def toml(models, model_a: dict | None = None) -> str:
    """demo-a (with `model_a`'s settings) and demo-b."""
    return dumps({"engine": {"max_tokens_cap": 64},
                  "models": {"demo-a": {"path": models.a, **(model_a or {})}, "demo-b": {"path": models.b}},
                  "aliases": {"default": "demo-a"}})


def chat(url: str, messages: list[dict], max_tokens: int = 6, model: str = "demo-a") -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=120,
                         json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})


def cached(r: requests.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def health(url: str) -> dict:
    return settled_health(url)


def test_quantised_entries_are_kept_and_never_cross_kv_bits(tmp_path, demo_models):
    """8-bit KV (demo-a's own setting): answered, /health says 8 bits; the
    next turn reuses the conversation; the entry on disk is mlx-lm's
    QuantizedKVCache; an engine at 16 bits does not reuse it, one at 8 does."""
    home = tmp_path / "home"
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "remember this"}]
    eight = toml(demo_models, model_a={"kv_bits": 8, "kv_group_size": 32})
    with engine_in(home, eight) as ep:
        r = chat(ep.url, first)
        assert cached(r) == 0
        assert health(ep.url)["kv_cache"] == {"bits": 8, "group_size": 32, "quantized_start": 0, "coarse_steps": False}
        turn = first + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "and then?"}]
        assert cached(chat(ep.url, turn)) > 300
        wait_until(lambda: health(ep.url)["prompt_cache"]["disk_entries"] >= 1, 30, what="the entry on disk")
        assert chat(ep.url, [{"role": "user", "content": "hi"}], model="demo-b").status_code == 200
        assert health(ep.url)["kv_cache"]["bits"] == 16  # demo-b keeps the engine's default
    import json

    import numpy as np
    from safetensors import safe_open

    kv = home / "state" / "kv"
    manifests = [json.loads(f.read_text()) for f in kv.glob("*.json") if f.name != "rates.json"]
    assert manifests
    kinds = {"quantised" if all(k == "q8g32" for k in m["layout"]) else "plain" for m in manifests
             if all(k in ("q8g32", "kv") for k in m["layout"])}
    assert kinds == {"quantised", "plain"}  # demo-a's entries quantised, demo-b's not
    quantised = next(m for m in manifests if m["layout"][0] == "q8g32")
    with safe_open(str(kv / "blocks" / f"{quantised['blocks'][0]}.safetensors"), "np") as fh:
        assert fh.get_tensor("0.k.0").dtype == np.uint32  # packed 8-bit values, as mlx-lm's QuantizedKVCache
    again = turn + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    with engine_in(home, toml(demo_models)) as ep:  # 16 bits: demo-a's 8-bit entry is another build
        assert cached(chat(ep.url, again)) == 0
    with engine_in(home, eight) as ep:  # the 16-bit engine wrote its own; the 8-bit entry is gone with it
        r = chat(ep.url, again)
        assert r.status_code == 200


def test_a_request_too_long_at_16_bits_fits_at_8(start_engine, demo_models, tokenizer):
    """A budget with room for demo-a's weights and a request's KV at 8 bits,
    not at 16: the 16-bit engine refuses it (400 context_length_exceeded,
    before any MLX allocation), the 8-bit engine answers it."""
    from mlxd.memory_estimate import KVLayout, kv_allocated_tokens, kv_cache_bytes, kv_prefill_transient_bytes

    config = json.loads((demo_models.a / "config.json").read_text())
    weights = sum(f.stat().st_size for f in demo_models.a.glob("*.safetensors"))
    messages = [{"role": "user", "content": "word " * 280}]
    tokens = kv_allocated_tokens(len(prompt_ids(tokenizer, messages)) + 64)
    layout = KVLayout(8, 32)
    eight = kv_cache_bytes(config, tokens, layout=layout) + kv_prefill_transient_bytes(config, tokens, layout)
    sixteen = kv_cache_bytes(config, tokens)
    assert eight < sixteen
    budget = weights + (eight + sixteen) // 2
    engine = {"memory_fraction": 1.0, "max_tokens_cap": 64, "context_tokens": 16,
              "prompt_cache": {"enabled": False}}
    env = {"MLXD_MEMORY_TOTAL_BYTES": str(budget)}
    plain = start_engine(engine, env=env)
    r = chat(plain.url, messages, max_tokens=64)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    quantised = start_engine({**engine, "kv_bits": 8, "kv_group_size": 32}, env=env)
    r = chat(quantised.url, messages, max_tokens=64)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] + 64 <= tokens
