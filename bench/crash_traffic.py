"""Chat requests through the gateway while the engine crashes: the stack
they go to (supervisord + crash listener + engine + gateway in a temp home,
the Ollama stand-in as the fallback) and one request's fate. Shared by
bench/soak.py, bench/crash_loop.py and bench/recovery.py.

Outcomes of one request: `ok` (non-streaming answer with a finish_reason),
`complete` (stream with a finish_reason and `data: [DONE]`), `failed` (an
exception before any content: a lost request), `stream_error` (an explicit
error after content: an error event or a cut connection), `silent_truncation`
(a stream that ended with no finish_reason and no error), `incomplete` (a
non-streaming answer without a finish_reason), `spliced` (engine text then
stand-in text in one stream). The backend is the stand-in when the content
starts with its marker "[ollama-standin:", else the engine.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import openai

from mlxd.devkit.ollama_standin import start_standin
from mlxd.devkit.stack import Stack

from benchkit import demo_model  # bench/ is on sys.path: every importer is a script there

OLLAMA_MODEL = "llama3.2:3b"
STANDIN_MARK = "[ollama-standin:"
GOOD = ("ok", "complete")
EXPLICIT = ("failed", "stream_error")


@dataclass
class Settings:
    """The stack's supervision and the requests' mix."""

    seed: int = 1
    stream_ratio: float = 0.5
    min_tokens: int = 16
    max_tokens: int = 64
    request_timeout_s: float = 60.0
    stuck_grace_s: float = 1.5
    healthy_reset_s: float = 2.0
    loop_crashes: int = 1_000_000  # never degrade unless asked
    loop_window_s: float = 600.0
    cooldown_s: float = 10.0
    backoff_base_s: float = 0.2
    backoff_cap_s: float = 2.0
    max_concurrency: int = 1  # [engine] max_concurrency: above 1 the running requests are decoded as one batch
    standby_engine: bool = True  # [supervisor] standby_engine: a crash's restart takes over an imported process
    standby_delay_s: float = 10.0  # [supervisor] standby_delay_s
    prompt_cache_disk_gib: float | None = None  # [engine.prompt_cache] disk_gib; None: the default
    model: Path | None = None  # an mlx-lm model folder; default: demo model a, built once into DEFAULT_CACHE


@contextmanager
def crash_stack(s: Settings, home_root: Path | None = None, keep_home: bool = False) -> Iterator[Stack]:
    """The stack under test, up and ready, in a new temp home (mlxd-soak-*)
    under `home_root`; fault injection through `stack.fault_file`. At the
    end every process is stopped by pid and the home removed unless kept."""
    model = s.model or demo_model("a")[1]
    home = Path(tempfile.mkdtemp(prefix="mlxd-soak-", dir=home_root))
    standin = start_standin(models=(OLLAMA_MODEL,))
    batched = {"max_concurrency": s.max_concurrency} if s.max_concurrency != 1 else {}  # 1: the config as before
    disk = {"prompt_cache": {"disk_gib": s.prompt_cache_disk_gib}} if s.prompt_cache_disk_gib is not None else {}
    stack = Stack.create(home, model, model_name="soak", engine={"stuck_grace_s": s.stuck_grace_s, **batched, **disk},
                         supervisor={"backoff_base_s": s.backoff_base_s, "backoff_cap_s": s.backoff_cap_s,
                                     "healthy_reset_s": s.healthy_reset_s, "loop_crashes": s.loop_crashes,
                                     "loop_window_s": s.loop_window_s, "cooldown_s": s.cooldown_s,
                                     "health_interval_s": 0.25, "start_grace_s": 20,
                                     "standby_engine": s.standby_engine, "standby_delay_s": s.standby_delay_s},
                         gateway={"ollama_url": standin.url, "default_ollama_model": OLLAMA_MODEL})
    try:
        stack.up(180)
        yield stack
    finally:
        stack.stop()
        standin.stop()
        if not keep_home:
            shutil.rmtree(home, ignore_errors=True)


# --- one request -----------------------------------------------------------------------

class _Probe:
    """What the raw bytes of the last response showed: [DONE] and the tail."""

    def __init__(self) -> None:
        self.done = False
        self.tail = b""


class _WatchedStream(httpx.SyncByteStream):
    def __init__(self, inner, probe: _Probe) -> None:
        self.inner, self.probe = inner, probe

    def __iter__(self):
        for chunk in self.inner:
            buf = self.probe.tail + chunk
            if b"data: [DONE]" in buf:
                self.probe.done = True
            self.probe.tail = buf[-600:]
            yield chunk

    def close(self) -> None:
        self.inner.close()


class ProbeTransport(httpx.HTTPTransport):
    """An httpx transport that lets a client thread see whether the SSE
    stream really ended with `data: [DONE]` (the openai client hides it)."""

    probe = _Probe()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.probe = _Probe()
        response = super().handle_request(request)
        response.stream = _WatchedStream(response.stream, self.probe)
        return response


def make_client(base_url: str, key: str, timeout: float) -> tuple[openai.OpenAI, ProbeTransport]:
    transport = ProbeTransport()
    http = httpx.Client(transport=transport, timeout=timeout)
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=timeout,
                         http_client=http), transport


def request_shape(seed: int, i: int, s: Settings) -> tuple[bool, int, str]:
    """(stream, max_tokens, prompt) of request i: a function of the seed only."""
    rng = random.Random(f"{seed}-{i}")
    stream = rng.random() < s.stream_ratio
    max_tokens = rng.randint(s.min_tokens, s.max_tokens)
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "tell", "me", "more", "why"))
                     for _ in range(rng.randint(3, 80)))
    return stream, max_tokens, f"soak request {i}: {words}"  # unique: never quarantined as a repeat


def _error_fields(exc: BaseException) -> dict:
    body = getattr(exc, "body", None)
    code = body.get("code") if isinstance(body, dict) else None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
    return {"error_type": type(exc).__name__, "status": getattr(exc, "status_code", None), "code": code,
            "error": str(exc)[:500]}


def backend_of(text: str) -> str:
    return "ollama" if text.startswith(STANDIN_MARK) else "engine"


def one_request(client: openai.OpenAI, probe_of: ProbeTransport, i: int, s: Settings) -> dict:
    stream, max_tokens, prompt = request_shape(s.seed, i, s)
    rec: dict = {"i": i, "stream": stream, "max_tokens": max_tokens, "t0": time.time()}
    t0 = time.monotonic()
    parts: list[str] = []
    finish = None
    try:
        kw = dict(model="default", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                  temperature=0.7)
        if stream:
            for chunk in client.chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    c = chunk.choices[0]
                    if c.delta and c.delta.content:
                        if not parts:
                            rec["ttft_s"] = time.monotonic() - t0
                        parts.append(c.delta.content)
                    finish = c.finish_reason or finish
        else:
            r = client.chat.completions.create(**kw)
            parts.append(r.choices[0].message.content or "")
            finish = r.choices[0].finish_reason
            rec["completion_tokens"] = r.usage.completion_tokens if r.usage else None
        error = None
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, by type
        error = exc
    rec["latency_s"] = time.monotonic() - t0
    text = "".join(parts)
    rec.update(finish_reason=finish, chars=len(text), backend=backend_of(text) if parts else None)
    if stream:
        rec["done_seen"] = probe_of.probe.done
    if parts and STANDIN_MARK in text and not text.startswith(STANDIN_MARK):
        rec["outcome"] = "spliced"
    elif error is not None:
        rec["outcome"] = "stream_error" if parts else "failed"
        rec.update(_error_fields(error))
        if stream:
            rec["raw_tail"] = probe_of.probe.tail.decode(errors="replace")[-300:]
    elif finish is None:
        rec["outcome"] = "silent_truncation" if stream else "incomplete"
        rec["raw_tail"] = probe_of.probe.tail.decode(errors="replace")[-300:]
    else:
        rec["outcome"] = "complete" if stream else "ok"
        if stream and not rec["done_seen"]:
            rec["no_done"] = True  # a finish_reason but no [DONE]: reported, not a truncation
    return rec
