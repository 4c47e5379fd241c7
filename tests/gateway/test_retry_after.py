"""A busy engine's Retry-After reaches every client (issue 52, item 3): with
the engine's one place taken and its queue full, requests sent at once
through the gateway for a model whose Ollama fallback fails too are all
answered 429 with the engine's Retry-After and its error as it wrote it (its
code), on the fast path and on LiteLLM's path alike, and what the fallback
did in x-mlxd-fallback."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from mlxd.devkit.ollama_standin import start_standin
from mlxd.toml_text import dumps, table_lines
from testkit import wait_until

pytestmark = pytest.mark.timeout(300)
AT_ONCE = 8


@pytest.fixture(scope="module")
def ollama():
    with start_standin(models=("llama3.2:3b",)) as standin:
        yield standin


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "litellm-path"])
def test_every_busy_answer_keeps_the_engines_retry_after(stack, ollama, demo_models, fast_path):
    st = stack(engine=table_lines({"max_queue": 1, "max_tokens_cap": 100000}),
               gateway=table_lines({"ollama_url": ollama.url, "engine_fast_path": fast_path}),
               models=dumps({"models": {"lonely": {"path": demo_models.a, "ollama": "missing:1b"}}}))
    holder = requests.post(st.url + "/v1/completions", stream=True, timeout=60,
                           json={"model": "default", "prompt": "hold", "max_tokens": 100000, "stream": True,
                                 "temperature": 0})
    holder.lines = holder.iter_lines()
    next(holder.lines)
    waiter = threading.Thread(target=lambda: requests.post(st.url + "/v1/completions", timeout=60, json={
        "model": "default", "prompt": "w", "max_tokens": 2}))
    waiter.start()
    try:
        wait_until(lambda: requests.get(st.url + "/health", timeout=5).json()["queue_depth"] == 1, 30,
                   what="the engine's queue full")

        def ask(i: int) -> requests.Response:
            return requests.post(st.gateway_url + "/v1/chat/completions", timeout=60,
                                 headers={"Authorization": f"Bearer {st.key}"},
                                 json={"model": "lonely", "max_tokens": 4,
                                       "messages": [{"role": "user", "content": f"busy? {i}"}]})

        with ThreadPoolExecutor(AT_ONCE) as pool:
            answers = list(pool.map(ask, range(AT_ONCE)))
        for r in answers:
            assert r.status_code == 429, r.text
            assert int(r.headers.get("retry-after", 0)) >= 1, (dict(r.headers), r.text)
            err = r.json()["error"]
            assert err["code"] == "queue_full" and "litellm" not in err["message"].lower(), err
            assert "missing:1b" in r.headers["x-mlxd-fallback"] or "Ollama" in r.headers["x-mlxd-fallback"]
    finally:
        holder.close()
        waiter.join(60)
