"""The model zoo: every architecture mlxd serves, each a tiny random-weight
model stored as bfloat16 (devkit/model_zoo.py), served by a real `mlxd
engine` -- one engine holding the whole zoo, which swaps one model in after
another -- through chat, prompt-cache reuse across turns and after a
SIGABRT (the disk tier), two requests batched, 8-bit KV, a json_schema
answer and a forced tool call. Run with `cpu_float32` off (the weights as
stored on the CPU: a MoE's experts cast to float32 only, engine/cpu/backend_ops.py)
and on (the CPU's float32 path).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from mlxd.devkit.model_zoo import MODELS, build_zoo
from mlxd.toml_text import dumps
from testkit import settled_health, spawn_engine, wait_healthy, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ZOO = list(MODELS)
SYSTEM = "You are the careful assistant of the mlxd project, and you answer briefly. " * 40  # ~600 tokens
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
NO_ATTENTION = {"mamba2"}  # state-space layers only: no KV for kv_bits to quantise
# Multi-head latent attention multiplies by its cache's arrays itself: its rows cannot be decoded apart
# (engine/model/row_attention.py checks it at load), so mlx-lm's padded batch serves it.
ROWS_PADDED = {"deepseek_v3"}


@dataclass
class Zoo:
    """The engine serving the zoo (replaced by the SIGABRT's restart)."""

    home: Path
    config: str
    engine: object = None

    @property
    def url(self) -> str:
        return self.engine.url

    def start(self) -> None:
        self.engine = spawn_engine(self.home, self.config)
        wait_healthy(self.engine, timeout=120)

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()


def zoo_config(folders: dict[str, Path], cpu_float32: bool) -> str:
    models = {}
    for name, folder in folders.items():
        models[name] = {"path": str(folder)}
        models[f"{name}-kv8"] = {"path": str(folder), "kv_bits": 8, "max_concurrency": 1}
    return dumps({"embeddings": {}, "aliases": {"default": next(iter(folders))}, "models": models,
                  "engine": {"max_tokens_cap": 1024, "max_concurrency": 2, "batching": "always", "cpu_float32": cpu_float32,
                             "stuck_grace_s": 60}})


@pytest.fixture(scope="module")
def zoo_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_zoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="module", params=[False, True], ids=["as_stored", "cpu_float32"])
def zoo(request, zoo_folders, tmp_path_factory) -> Zoo:
    home = tmp_path_factory.mktemp(f"zoo-home-{request.param}")
    z = Zoo(home, zoo_config(zoo_folders, request.param))
    z.start()
    yield z
    z.stop()


def post(url: str, model: str, messages: list[dict], max_tokens: int = 6, **extra) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def reply_of(answer: dict) -> dict:
    message = answer["choices"][0]["message"]
    return {"role": "assistant", "content": message.get("content") or ""}


@pytest.mark.parametrize("model", ZOO)
def test_chat_and_the_next_turn_reuses_the_prompt(zoo, model):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    first = post(zoo.url, model, messages)
    assert first["usage"]["completion_tokens"] > 0 and first["choices"][0]["finish_reason"] in ("stop", "length")
    messages += [reply_of(first), {"role": "user", "content": "second question"}]
    second = post(zoo.url, model, messages)
    usage = second["usage"]
    assert cached(usage) >= 0.9 * usage["prompt_tokens"], usage


@pytest.mark.parametrize("model", ZOO)
def test_8_bit_kv(zoo, model):
    messages = [{"role": "user", "content": "hello in eight bits"}]
    answer = post(zoo.url, f"{model}-kv8", messages, max_tokens=8)
    assert answer["usage"]["completion_tokens"] > 0
    kv = settled_health(zoo.url)["kv_cache"]
    assert kv is not None and kv["bits"] == (16 if model in NO_ATTENTION else 8), kv


@pytest.mark.parametrize("model", ZOO)
def test_json_schema_answer(zoo, model):
    answer = post(zoo.url, model, [{"role": "user", "content": "Is it ok? Answer as JSON."}], max_tokens=256,
                  response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA,
                                                                          "strict": True}})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert set(json.loads(choice["message"]["content"])) == {"ok"}


@pytest.mark.parametrize("model", ZOO)
def test_forced_tool_call(zoo, model):
    answer = post(zoo.url, model, [{"role": "user", "content": "The weather in Paris?"}], max_tokens=256,
                  tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    choice = answer["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert choice["finish_reason"] == "tool_calls" and len(calls) == 1, choice
    assert calls[0]["function"]["name"] == "get_weather"
    assert set(json.loads(calls[0]["function"]["arguments"])) == {"city"}


@pytest.mark.parametrize("model", ZOO)
def test_two_requests_are_decoded_together(zoo, model):
    """A long streamed answer is running; a second request (max_concurrency 2)
    is answered while it still runs: it joined the batch, it did not wait."""
    post(zoo.url, model, [{"role": "user", "content": "warm up"}], max_tokens=1)  # the model resident first
    body = {"model": model, "messages": [{"role": "user", "content": "a long story please"}], "max_tokens": 1000,
            "temperature": 0, "stream": True}
    with requests.post(zoo.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as long:
        assert long.status_code == 200
        lines = long.iter_lines()
        wait_until(lambda: next(lines).startswith(b"data: {"), 60, interval=0, what="the long answer's first token")
        short = post(zoo.url, model, [{"role": "user", "content": "and a short one"}], max_tokens=4)
        assert short["usage"]["completion_tokens"] > 0
        # The long one still runs once the short one is let go: the short one did not wait for it.
        health = wait_until(lambda: (lambda h: h if len(h["running"]) == 1 else None)(
            requests.get(zoo.url + "/health", timeout=5).json()), 10, what="the short answer's row let go")
        assert health["serving"]["max_concurrency"] == 2 and health["serving"]["decoder"] == "batch", health
        assert health["serving"]["rows_apart"] == (model not in ROWS_PADDED), health["serving"]
    settled_health(zoo.url)  # the long one cancelled as its client left


def two_turns(url: str, model: str, opening: str) -> list[dict]:
    """A conversation of two turns with `model`, and the third turn's messages."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{opening} first"}]
    messages += [reply_of(post(url, model, messages)), {"role": "user", "content": f"{opening} second"}]
    return messages + [reply_of(post(url, model, messages)), {"role": "user", "content": f"{opening} third"}]


def writes_settled(url: str) -> dict:
    return wait_until(lambda: (lambda h: h if h["prompt_cache"]["disk_writes_pending"] == 0 else None)(
        settled_health(url)), 60, what="the prompt cache's writes")


@pytest.fixture(scope="module")
def aborted(zoo) -> tuple[Zoo, dict[str, list[dict]]]:
    """Two turns with every model, then the engine SIGABRTed (as Metal
    aborts) once its writes are on disk, and started again on the same home;
    each model's third turn to send."""
    conversations = {model: two_turns(zoo.url, model, "before the abort") for model in ZOO}
    writes_settled(zoo.url)
    os.kill(zoo.engine.proc.pid, signal.SIGABRT)
    zoo.engine.proc.wait(30)
    zoo.start()
    return zoo, conversations


@pytest.mark.parametrize("model", ZOO)
def test_the_next_turn_after_a_sigabrt_reuses_the_disk_tier(aborted, model):
    zoo, conversations = aborted
    usage = post(zoo.url, model, conversations[model])["usage"]
    assert cached(usage) >= 0.9 * usage["prompt_tokens"], usage


@pytest.mark.parametrize("model", ["gpt_oss", "mamba2"])  # rotating (sliding-window) layers; state-space layers
def test_a_turn_of_a_model_without_kv_blocks_is_on_disk_as_soon_as_its_answer_is_out(zoo_folders, tmp_path, model):
    """Layers that cannot be cut into blocks go to disk as one file per turn:
    written as the turn ends (not only once the engine idles, or the model
    leaves memory), so a SIGABRT right after an answer loses nothing."""
    home = tmp_path / "home"
    config = zoo_config({model: zoo_folders[model]}, cpu_float32=False)
    z = Zoo(home, config)
    z.start()
    try:
        messages = two_turns(z.url, model, "right after the answer")
        report = writes_settled(z.url)["prompt_cache"]
        assert report["disk_writes"] >= 1, report
        os.kill(z.engine.proc.pid, signal.SIGABRT)
        z.engine.proc.wait(30)
        z.start()
        usage = post(z.url, model, messages)["usage"]
        assert cached(usage) >= 0.9 * usage["prompt_tokens"], usage
    finally:
        z.stop()
