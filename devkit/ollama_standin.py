"""TEST DOUBLE of Ollama's HTTP API — an "Ollama stand-in", NOT Ollama.

Ollama cannot be installed where mlxd's tests run, so this small server speaks the parts
of Ollama's HTTP API that LiteLLM's `ollama_chat/<model>` provider uses, so tests drive
LiteLLM's real provider against it. It runs no model: each answer is the marker
"[ollama-standin:<model>] " then the last user message's words (a word per streamed chunk),
cut to `options.num_predict` words; each echoed word is one token, the marker is free.

Endpoints (shapes as in Ollama's docs/api.md; unknown models get 404 {"error": "model 'x' not found"}):
  POST /api/chat     streaming NDJSON (the default when `stream` is absent) or one JSON
                     object; honours options.num_predict (done_reason "length"); answers
                     with message.tool_calls when `tools` are given and the last message
                     is not a tool result; empty `messages` is Ollama's "load" request
  GET  /api/tags     the configured models
  GET  /api/version  {"version": "<VERSION>"}
  POST /api/show     model details (LiteLLM's model-info lookup posts {"name": model})
  POST /api/embed    {"model", "embeddings": [[...]], "prompt_eval_count"...} for `input` (a string or a
                     list): each vector of EMBED_DIMENSIONS unit floats derived from its text's hash,
                     so the same text gets the same vector (no model: not similar texts' vectors)
Test-only: GET /_standin/stats -> {"chat_requests", "embed_requests", "last_request", "requests"}.

Run: python -m mlxd.devkit.ollama_standin --port N --models llama3.2:3b,qwen2.5:7b
     [--chunk-delay SECONDS]     (binds 127.0.0.1 only; logs warnings only)
Or from a test or a benchmark: `start_standin(models, chunk_delay)` -> StandinProcess (.url
.port .proc .stats() .stop()), a real process on a free port, up once /api/version answers.
What LiteLLM's provider really calls, and why: devkit/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxd.devkit.ports import free_port

VERSION = "0.6.8"  # the Ollama version this double claims to be
DEFAULT_MODELS = ("llama3.2:3b", "qwen2.5:7b")
CONTEXT_LENGTH = 8192  # what /api/show reports as <arch>.context_length
EMBED_DIMENSIONS = 384  # all-minilm's
_DETAILS = {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
            "parameter_size": "1B", "quantization_level": "Q4_K_M"}


def marker(model: str) -> str:
    return f"[ollama-standin:{model}] "


def _canonical(name: str) -> str:
    """Ollama's names: a missing tag means ':latest'."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"


def _text_vector(text: str) -> list[float]:
    """A unit vector of EMBED_DIMENSIONS floats from the text's hash (the same text, the same vector)."""
    digest = hashlib.sha256(text.encode()).digest() * (EMBED_DIMENSIONS // 32 + 1)
    values = [b / 255.0 - 0.5 for b in digest[:EMBED_DIMENSIONS]]
    norm = sum(v * v for v in values) ** 0.5 or 1.0
    return [v / norm for v in values]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _text(message: dict) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""  # LiteLLM flattens content parts to a string


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _body(request: Request) -> dict | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def create_app(models=DEFAULT_MODELS, chunk_delay: float = 0.0) -> FastAPI:
    """The stand-in as an ASGI app: `models` are the names it has "pulled"; `chunk_delay`
    seconds are slept before each streamed chunk (their sum before a non-streamed answer)."""
    known = {_canonical(m) for m in models}
    stats: dict = {"chat_requests": 0, "embed_requests": 0, "last_request": None, "requests": {}}
    app = FastAPI(title="ollama-standin (test double)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def count(request: Request, call_next):
        key = f"{request.method} {request.url.path}"
        stats["requests"][key] = stats["requests"].get(key, 0) + 1
        return await call_next(request)

    @app.get("/api/version")
    async def version():
        return {"version": VERSION}

    @app.get("/api/tags")
    async def tags():
        return {"models": [{
            "name": name, "model": name, "modified_at": "2025-01-01T00:00:00Z", "size": 1_000_000,
            "digest": hashlib.sha256(name.encode()).hexdigest(), "details": _DETAILS} for name in models]}

    @app.post("/api/show")
    async def show(request: Request):
        body = await _body(request) or {}
        name = body.get("model") or body.get("name") or ""  # LiteLLM sends the older "name"
        if _canonical(name) not in known:
            return _error(404, f"model '{name}' not found")
        return {
            "modelfile": f"# ollama-standin test double\nFROM {name}\n", "parameters": "",
            "template": "{{ if .Tools }}tools{{ end }}{{ .Prompt }}", "details": _DETAILS,
            "model_info": {"general.architecture": "llama", "llama.context_length": CONTEXT_LENGTH},
            "capabilities": ["completion", "tools"],
        }

    @app.get("/_standin/stats")
    async def get_stats():
        return stats

    async def taken(request: Request, counter: str) -> dict | JSONResponse:
        """A request's body, counted; or the error Ollama answers (bad JSON, no or an unknown model)."""
        body = await _body(request)
        if body is None:
            return _error(400, "invalid JSON body")
        stats[counter] += 1
        stats["last_request"] = body
        model = body.get("model") or ""
        if not model:
            return _error(400, "model is required")
        if _canonical(model) not in known:
            return _error(404, f"model '{model}' not found")
        return body

    @app.post("/api/embed")
    async def embed(request: Request):
        started = time.perf_counter_ns()
        body = await taken(request, "embed_requests")
        if isinstance(body, JSONResponse):
            return body
        model, inputs = body["model"], body.get("input")
        texts = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return _error(400, "input must be a string or a list of strings")
        return {"model": model, "embeddings": [_text_vector(t) for t in texts],
                "total_duration": time.perf_counter_ns() - started, "load_duration": 0,
                "prompt_eval_count": sum(len(t.split()) for t in texts)}

    @app.post("/api/chat")
    async def chat(request: Request):
        started = time.perf_counter_ns()
        body = await taken(request, "chat_requests")
        if isinstance(body, JSONResponse):
            return body
        model = body["model"]
        messages = body.get("messages") or []
        stream = body.get("stream", True) is not False  # Ollama streams unless told not to
        head = {"model": model, "created_at": _now()}
        if not messages:  # Ollama's "load the model" request
            return {**head, "message": {"role": "assistant", "content": ""}, "done_reason": "load", "done": True}

        user = [_text(m) for m in messages if m.get("role") == "user"]
        words = (user[-1] if user else "").split() or ["ok"]
        limit = (body.get("options") or {}).get("num_predict")
        done_reason = "stop"
        if isinstance(limit, int) and 0 <= limit < len(words):
            words, done_reason = words[:limit], "length"
        tools = body.get("tools") or []
        pieces = [marker(model).rstrip()] + [" " + w for w in words]
        messages_out = [{"role": "assistant", "content": p} for p in pieces]
        if tools and messages[-1].get("role") != "tool":  # call the first tool, string args = the words
            fn = tools[0].get("function", tools[0])
            props = (fn.get("parameters") or {}).get("properties") or {}
            args = {k: " ".join(words) for k, v in props.items() if v.get("type", "string") == "string"}
            messages_out = [{"role": "assistant", "content": "",
                             "tool_calls": [{"function": {"name": fn.get("name", ""), "arguments": args}}]}]
        prompt_count = max(1, sum(len(_text(m).split()) for m in messages))
        counts = {"load_duration": 1_000, "prompt_eval_count": prompt_count,
                  "prompt_eval_duration": 1_000 * prompt_count, "eval_count": len(words)}

        def final(message: dict, gen_started: int) -> dict:
            now = time.perf_counter_ns()
            return {**head, "created_at": _now(), "message": message, "done_reason": done_reason, "done": True,
                    "total_duration": now - started, **counts, "eval_duration": max(1, now - gen_started)}

        if not stream:
            await asyncio.sleep(chunk_delay * len(messages_out))
            whole = {**messages_out[0], "content": "".join(m["content"] for m in messages_out)}
            return final(whole, started)

        async def lines():
            gen_started = time.perf_counter_ns()
            for message in messages_out:  # a word per chunk; tool calls whole, in one chunk
                await asyncio.sleep(chunk_delay)
                yield json.dumps({**head, "created_at": _now(), "message": message, "done": False}) + "\n"
            # LiteLLM's stream parser reads chunk["message"] even in the final object: keep it
            yield json.dumps(final({"role": "assistant", "content": ""}, gen_started)) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


# ---- running it as a real process -------------------------------------------------

def _get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@dataclass
class StandinProcess:
    port: int
    proc: subprocess.Popen
    log_path: Path

    def __enter__(self) -> "StandinProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        return _get_json(self.url + "/_standin/stats")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM by pid, then SIGKILL if it has not exited within `timeout`."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
        self.log_path.unlink(missing_ok=True)


def start_standin(models=DEFAULT_MODELS, chunk_delay: float = 0.0, port: int | None = None,
                  timeout: float = 30.0) -> StandinProcess:
    """Start the stand-in as a subprocess (on a free port unless given) and return once
    GET /api/version answers; raise RuntimeError (with its log) if it dies or the deadline passes."""
    port = port or free_port()
    fd, log_name = tempfile.mkstemp(prefix="ollama-standin-", suffix=".log")
    cmd = [sys.executable, "-m", "mlxd.devkit.ollama_standin", "--port", str(port),
           "--models", ",".join(models), "--chunk-delay", str(chunk_delay)]
    with os.fdopen(fd, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    sp = StandinProcess(port, proc, Path(log_name))
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if _get_json(sp.url + "/api/version", timeout=1.0).get("version") == VERSION:
                return sp
        except OSError:  # not listening yet (URLError, ConnectionError and timeouts are OSErrors)
            pass
        time.sleep(0.05)
    log, status = sp.log(), proc.poll()
    sp.stop()
    raise RuntimeError(f"ollama-standin gave no /api/version within {timeout}s (exit status {status}):\n{log}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="TEST DOUBLE of Ollama's HTTP API (not Ollama).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated model names")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds slept before each streamed chunk")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    # Ollama's Go server keeps idle connections open (no idle timeout); uvicorn's
    # default closes them after 5 s, and a client that reuses one at that moment
    # (LiteLLM keeps them 15 s) fails its request: a stand-in artefact, not Ollama's.
    uvicorn.run(create_app(models, args.chunk_delay), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False, timeout_keep_alive=300)


if __name__ == "__main__":
    main()
