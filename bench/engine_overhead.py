#!/usr/bin/env python3
"""Engine overhead: streaming decode throughput and TTFT of one model, three ways.

  in-process     mlx_lm.generate.stream_generate in this process (the ceiling)
  mlxd engine    `python -m mlxd.cli engine`, streamed POST /v1/completions
  mlx_lm.server  `python -m mlx_lm server`, streamed POST /v1/completions

Same model, same prompt string (tokenized by the same tokenizer; the prompt
token counts are checked through `usage`), greedy sampling (temperature 0) and
a fixed max_tokens. The demo models never emit EOS, so every run generates
exactly max_tokens tokens. The three ways alternate in rounds (the starting
way rotates each round) after warmup runs, and the medians are compared.
CPU time per token (server process + client) is recorded as well: it shows
the overhead even when other programs make the timings noisy.

Metrics, identical for all three ways (see bench/README.md):
  TTFT            t0 -> first content-carrying chunk (non-empty text), where
                  t0 is just before the request is sent (in-process: just
                  before the prompt is tokenized)
  decode tok/s    (window - 1) / (t_last - t_first), t_first / t_last being the
                  arrival of the first / last content-carrying chunk and window
                  the number of tokens from the first to the last of them (=
                  completion_tokens when no generated token has empty text; the
                  in-process run measures it, servers reuse it for equal output)

Usage:
  .venv/bin/python bench/engine_overhead.py             # demo models a and b (~1-2 min on 2 cores)
  .venv/bin/python bench/engine_overhead.py --quick     # well under a minute
  .venv/bin/python bench/engine_overhead.py --model /path/to/mlx/model --rounds 9

Progress goes to stderr (one line per run), the Markdown table to stdout,
all raw samples to --out (JSON).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "engine_overhead.json"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxd-bench"
# Chosen so that the greedy continuations of both demo models start and end
# with a token that has text (see "decode window" in bench/README.md).
DEFAULT_PROMPT = ("Tokens stream back one by one. The first token takes longest, because the prompt must be "
                  "processed; after that, every step is a small matrix product per layer.")
WAYS = ("inproc", "engine", "mlx_lm")
LABEL = {"inproc": "in-process", "engine": "mlxd engine", "mlx_lm": "mlx_lm.server"}

now = time.perf_counter


class BenchError(RuntimeError):
    pass


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- one run's raw observations -> one sample ------------------------------------

@dataclass
class Trace:
    t0: float
    chunk_times: list[float]  # arrival of each content-carrying chunk
    completion_tokens: int
    prompt_tokens: int
    text: str
    finish_reason: str | None
    t_end: float
    cached_prompt_tokens: int | None = None
    # Tokens from the first to the last content-carrying one, both included;
    # known exactly in-process only (a server sends nothing for a token whose
    # text is empty, e.g. half of a multi-byte character).
    window_tokens: int | None = None
    # CPU seconds spent during the run (filled in by measure()).
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    background_cores: float | None = None


@dataclass
class Sample:
    model: str
    way: str
    round: int  # 0-based; warmups are numbered separately
    warmup: bool
    ttft_ms: float
    decode_tok_s: float
    completion_tokens: int
    prompt_tokens: int
    content_chunks: int
    total_s: float
    finish_reason: str | None
    text_sha1: str
    cached_prompt_tokens: int | None
    decode_window_tokens: int
    window_source: str  # "exact", "in-process reference" or "assumed (no empty-text tokens)"
    # CPU per generated token: the generating process (the server, or this
    # process in-process) and the HTTP client (this process); noise-robust.
    server_cpu_us_per_token: float
    client_cpu_us_per_token: float
    # CPU used by everything else on the machine during the run, in cores
    # (other programs competing for the CPUs make the run slower).
    background_cores: float | None
    chunk_times_ms: list[float] = field(repr=False)  # relative to t0


def text_sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def to_sample(tr: Trace, model: str, way: str, rnd: int, warmup: bool, ref_windows: dict[str, int]) -> Sample:
    """`ref_windows`: text hash -> decode window measured in-process. Greedy
    output is deterministic, so a server run that produced the same text had
    the same window."""
    if not tr.chunk_times:
        raise BenchError(f"{way}: no content-carrying chunk came back")
    sha = text_sha1(tr.text)
    if tr.window_tokens is not None:
        window, source = tr.window_tokens, "exact"
    elif sha in ref_windows:
        window, source = ref_windows[sha], "in-process reference"
    else:
        window, source = tr.completion_tokens, "assumed (no empty-text tokens)"
    first, last = tr.chunk_times[0], tr.chunk_times[-1]
    decode = (window - 1) / (last - first) if last > first and window > 1 else math.nan
    return Sample(model=model, way=way, round=rnd, warmup=warmup, ttft_ms=(first - tr.t0) * 1e3,
                  decode_tok_s=decode, completion_tokens=tr.completion_tokens, prompt_tokens=tr.prompt_tokens,
                  content_chunks=len(tr.chunk_times), total_s=tr.t_end - tr.t0, finish_reason=tr.finish_reason,
                  text_sha1=sha, cached_prompt_tokens=tr.cached_prompt_tokens, decode_window_tokens=window,
                  window_source=source,
                  server_cpu_us_per_token=tr.server_cpu_s / max(tr.completion_tokens, 1) * 1e6,
                  client_cpu_us_per_token=tr.client_cpu_s / max(tr.completion_tokens, 1) * 1e6,
                  background_cores=tr.background_cores,
                  chunk_times_ms=[round((t - tr.t0) * 1e3, 3) for t in tr.chunk_times])


def _busy_cpu_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def measure(runner: "InProcess | HttpWay", prompt: str, max_tokens: int) -> Trace:
    """One run, with CPU accounting: the generating process, the client and
    the rest of the machine."""
    server = psutil.Process(runner.server.proc.pid) if isinstance(runner, HttpWay) else None
    busy0, wall0 = _busy_cpu_s(), now()
    srv0 = sum(server.cpu_times()[:2]) if server else 0.0
    me0 = time.process_time()
    tr = runner.run(prompt, max_tokens)
    me = time.process_time() - me0
    srv = sum(server.cpu_times()[:2]) - srv0 if server else 0.0
    busy, wall = _busy_cpu_s() - busy0, now() - wall0
    if server:
        tr.server_cpu_s, tr.client_cpu_s = srv, me
    else:
        tr.server_cpu_s, tr.client_cpu_s = me, 0.0
    tr.background_cores = max(0.0, busy - srv - me) / wall if wall > 0 else None
    return tr


# --- the three ways ----------------------------------------------------------------

class InProcess:
    way = "inproc"

    def __init__(self, model_path: Path) -> None:
        from mlx_lm.utils import load

        self.model, self.tokenizer = load(str(model_path))

    def run(self, prompt: str, max_tokens: int) -> Trace:
        from mlx_lm.generate import stream_generate  # (`import mlx_lm.generate` gives the function)
        from mlx_lm.sample_utils import make_sampler

        t0 = now()
        tokens = self.tokenizer.encode(prompt)
        times: list[float] = []
        parts: list[str] = []
        n, finish, first_n, last_n = 0, None, 0, 0
        for resp in stream_generate(self.model, self.tokenizer, tokens, max_tokens=max_tokens,
                                    sampler=make_sampler(temp=0.0)):
            if resp.text:
                times.append(now())
                parts.append(resp.text)
                first_n = first_n or resp.generation_tokens
                last_n = resp.generation_tokens
            n, finish = resp.generation_tokens, resp.finish_reason
        return Trace(t0, times, n, len(tokens), "".join(parts), finish, now(),
                     window_tokens=last_n - first_n + 1 if times else None)

    def close(self) -> None:
        self.model = self.tokenizer = None


class HttpWay:
    """A streaming OpenAI /v1/completions client with as little per-chunk work
    as possible: bytes are read as they arrive (read1), split into SSE events
    and timestamped; JSON is parsed only after the stream ends."""

    def __init__(self, way: str, url: str, model_name: str, server: "Server") -> None:
        self.way = way
        self.url = url
        self.model_name = model_name
        self.server = server
        self.session = requests.Session()

    def run(self, prompt: str, max_tokens: int, read_timeout: float = 300.0) -> Trace:
        payload = json.dumps({"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens,
                              "temperature": 0.0, "stream": True,
                              "stream_options": {"include_usage": True}}).encode()
        return self.stream("/v1/completions", payload, {"Content-Type": "application/json"}, read_timeout)

    def stream(self, path: str, payload: bytes, headers: dict[str, str], read_timeout: float) -> Trace:
        """POST `payload`, read the SSE answer as it arrives, timestamp each event."""
        events: list[tuple[float, bytes]] = []
        t0 = now()
        with self.session.post(self.url + path, data=payload, stream=True, headers=headers,
                               timeout=(10, read_timeout)) as r:
            if r.status_code != 200:
                raise BenchError(f"{self.way}: HTTP {r.status_code}: {r.text[:500]}")
            raw, buf = r.raw, b""
            while True:
                data = raw.read1(65536)  # whatever has arrived; never waits for a full buffer
                t = now()
                if not data:
                    break
                buf += data
                while (i := buf.find(b"\n\n")) >= 0:
                    events.append((t, buf[:i]))
                    buf = buf[i + 2:]
        t_end = events[-1][0] if events else now()
        return self._parse(t0, events, t_end)

    def _parse(self, t0: float, events: list[tuple[float, bytes]], t_end: float) -> Trace:
        times: list[float] = []
        parts: list[str] = []
        usage: dict[str, Any] | None = None
        finish = None
        done = False
        for t, ev in events:
            for line in ev.decode().splitlines():
                if not line.startswith("data:"):
                    continue  # SSE comments (mlx_lm.server's ": keepalive")
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    raise BenchError(f"{self.way}: error in stream: {obj['error']}")
                for choice in obj.get("choices") or []:
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    if text:
                        times.append(t)
                        parts.append(text)
                    finish = choice.get("finish_reason") or finish
                if obj.get("usage"):
                    usage = obj["usage"]
        if not done:
            raise BenchError(f"{self.way}: the stream ended without [DONE]")
        if usage is None:
            raise BenchError(f"{self.way}: no usage chunk (stream_options.include_usage ignored?)")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Trace(t0, times, int(usage["completion_tokens"]), int(usage["prompt_tokens"]), "".join(parts),
                     finish, t_end, cached)

    def close(self) -> None:
        self.session.close()


# --- subprocesses ----------------------------------------------------------------------

_children: list[subprocess.Popen] = []


def _resolve_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None


_PRCTL = _resolve_prctl()


def _child_setup() -> None:
    """In the child, before exec (Linux): get SIGTERM when the benchmark dies,
    even by SIGKILL, when it never reaches its `finally`."""
    _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    health_path: str
    log_path: Path

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if requests.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.1)


def spawn(name: str, argv: list[str], env: dict[str, str], log_path: Path, port: int, health_path: str) -> Server:
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True,  # a Ctrl-C reaches us only; we stop them ourselves
                                preexec_fn=_child_setup if _PRCTL is not None else None)
    _children.append(proc)
    return Server(name, proc, f"http://127.0.0.1:{port}", health_path, log_path)


def stop_child(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM by pid (the engine drains: it is idle, so that is quick), then SIGKILL."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass
    if proc in _children:
        _children.remove(proc)


def stop_all_children() -> None:
    for proc in list(_children):
        try:
            stop_child(proc)
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            say(f"could not stop pid {proc.pid}: {exc}")


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("MLXD_CONFIG", None)
    return env


def start_engine(model_path: Path, workdir: Path) -> Server:
    home = workdir / "mlxd-home"
    home.mkdir()
    (home / "mlxd.toml").write_text(
        # stuck_grace_s: a slow CPU's long prefill must not count as a hang here
        "[engine]\nmax_tokens_cap = 100000\nstuck_grace_s = 600\n\n"
        f"[models.bench]\npath = {json.dumps(str(model_path.resolve()))}\n\n"
        '[aliases]\ndefault = "bench"\n')
    port = free_port()
    argv = [sys.executable, "-m", "mlxd.cli", "engine", "--port", str(port)]
    return spawn("mlxd engine", argv, child_env(MLXD_HOME=str(home)), workdir / "engine.log", port, "/health")


def start_mlx_lm(model_path: Path, workdir: Path, prompt_cache: bool) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_path.resolve()), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "WARNING"]
    if not prompt_cache:
        argv += ["--prompt-cache-size", "0"]  # every request prefills its prompt, as the other two do
    return spawn("mlx_lm.server", argv, child_env(), workdir / "mlx_lm_server.log", port, "/v1/models")


# --- machine info ------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        if sys.platform == "darwin":
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except Exception:  # noqa: BLE001
        pass
    return None


def _git() -> dict[str, Any]:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "core", "engine"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return {"commit": head or None, "engine_or_core_dirty": dirty}
    except Exception:  # noqa: BLE001
        return {"commit": None}


def _gpu_name() -> str | None:
    """The NVIDIA GPU's name when MLX runs on CUDA (Apple GPUs: mlx reports the device)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    import mlx.core as mx

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "mlx": _version("mlx") or getattr(mx, "__version__", None),
        "mlx_device": str(mx.default_device()),
        "gpu": _gpu_name(),
        "mlx_lm": _version("mlx-lm"),
        "http_stack": {d: _version(d) for d in ("uvicorn", "h11", "httptools", "uvloop", "fastapi", "starlette",
                                                "requests", "urllib3")},
        "git": _git(),
    }


# --- statistics and output -----------------------------------------------------------------

def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def summarize(samples: list[Sample], ways: list[str]) -> dict[str, Any]:
    """Per way: medians and ranges over the measured (non-warmup) runs; ratios
    against in-process as a ratio of medians and as the median of per-round
    (paired) ratios."""
    measured = [s for s in samples if not s.warmup]
    out: dict[str, Any] = {}
    for way in ways:
        ss = [s for s in measured if s.way == way]
        if not ss:
            continue
        dec = [s.decode_tok_s for s in ss]
        ttft = [s.ttft_ms for s in ss]
        out[way] = {"runs": len(ss), "decode_tok_s_median": _median(dec), "decode_tok_s_min": min(dec),
                    "decode_tok_s_max": max(dec), "ttft_ms_median": _median(ttft), "ttft_ms_min": min(ttft),
                    "ttft_ms_max": max(ttft), "total_s_median": _median([s.total_s for s in ss]),
                    "server_cpu_us_per_token_median": _median([s.server_cpu_us_per_token for s in ss]),
                    "client_cpu_us_per_token_median": _median([s.client_cpu_us_per_token for s in ss]),
                    "background_cores_median": _median([s.background_cores or 0.0 for s in ss]),
                    "completion_tokens": sorted({s.completion_tokens for s in ss}),
                    "prompt_tokens": sorted({s.prompt_tokens for s in ss})}
    base = out.get("inproc")
    if base:
        by_round = {s.round: s for s in measured if s.way == "inproc"}
        for way, st in out.items():
            st["decode_ratio_vs_inproc"] = st["decode_tok_s_median"] / base["decode_tok_s_median"]
            st["ttft_ratio_vs_inproc"] = st["ttft_ms_median"] / base["ttft_ms_median"]
            st["ttft_extra_ms_vs_inproc"] = st["ttft_ms_median"] - base["ttft_ms_median"]
            paired = [s.decode_tok_s / by_round[s.round].decode_tok_s for s in measured
                      if s.way == way and s.round in by_round]
            st["decode_ratio_paired_median"] = _median(paired)
    return out


def check_consistency(model: str, samples: list[Sample]) -> list[str]:
    """Prompt token counts must match; the generated tokens should too."""
    notes = []
    prompt_counts = {(s.way, s.prompt_tokens) for s in samples}
    if len({c for _, c in prompt_counts}) > 1:
        notes.append(f"{model}: PROMPT TOKEN COUNTS DIFFER: {sorted(prompt_counts)}")
    tok_counts = {(s.way, s.completion_tokens) for s in samples}
    if len({c for _, c in tok_counts}) > 1:
        notes.append(f"{model}: completion token counts differ: {sorted(tok_counts)}")
    texts = {}
    for s in samples:
        texts.setdefault(s.way, set()).add(s.text_sha1)
    if len({h for hs in texts.values() for h in hs}) > 1:
        notes.append(f"{model}: generated texts differ between runs/ways: "
                     + ", ".join(f"{w}={sorted(h)}" for w, h in texts.items()))
    odd = {(s.way, s.decode_window_tokens, s.completion_tokens) for s in samples
           if s.decode_window_tokens != s.completion_tokens}
    if odd:
        notes.append(f"{model}: some generated tokens at the start/end have empty text; decode tok/s counts the "
                     f"window between the first and last content chunk (way, window, tokens): {sorted(odd)}")
    guessed = {s.way for s in samples if s.window_source.startswith("assumed")}
    if guessed:
        notes.append(f"{model}: decode window assumed = completion tokens for {sorted(guessed)} (no in-process "
                     "run with the same text to take it from)")
    cached = {s.cached_prompt_tokens for s in samples if s.cached_prompt_tokens}
    if cached:
        notes.append(f"{model}: some prompt tokens came from a prompt cache ({sorted(cached)}): TTFT is optimistic")
    return notes


def markdown(results: dict[str, Any], settings: dict[str, Any], info: dict[str, Any]) -> str:
    lines = [
        f"### Engine overhead — {info['date']}",
        "",
        f"{info['platform']}, {info['cpu_count']} CPUs ({info['cpu'] or '?'}), Python {info['python']}, "
        f"mlx {info['mlx']} ({info['mlx_device']}), mlx-lm {info['mlx_lm']}, "
        f"uvicorn {info['http_stack']['uvicorn']} + {'httptools' if info['http_stack']['httptools'] else 'h11'}",
        f"greedy, max_tokens {settings['max_tokens']}, {settings['rounds']} rounds after {settings['warmup']} "
        f"warmup(s) per way, ways interleaved; medians (min–max). decode tok/s = (window−1)/(t_last−t_first) "
        f"over content-carrying chunks; TTFT = request sent → first content chunk; CPU = generating process + "
        f"HTTP client, µs per generated token.",
        "",
        "| model | way | decode tok/s | × in-process | TTFT ms | TTFT vs in-process | CPU µs/token | "
        "tokens (prompt+gen) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, res in results.items():
        for way, st in res["summary"].items():
            ratio = st.get("decode_ratio_vs_inproc")
            paired = st.get("decode_ratio_paired_median")
            ratio_s = "—" if ratio is None else (
                "1.000" if way == "inproc" else f"**{ratio:.3f}** (paired {paired:.3f})")
            extra = st.get("ttft_extra_ms_vs_inproc")
            ttft_vs = "—" if extra is None or way == "inproc" else f"{extra:+.1f} ms"
            lines.append(
                f"| {model} | {LABEL[way]} | {st['decode_tok_s_median']:.1f} ({st['decode_tok_s_min']:.0f}–"
                f"{st['decode_tok_s_max']:.0f}) | {ratio_s} | {st['ttft_ms_median']:.1f} ({st['ttft_ms_min']:.1f}–"
                f"{st['ttft_ms_max']:.1f}) | {ttft_vs} | {st['server_cpu_us_per_token_median']:.0f}"
                f"{'' if way == 'inproc' else '+%.0f' % st['client_cpu_us_per_token_median']} | "
                f"{'/'.join(map(str, st['prompt_tokens']))}+{'/'.join(map(str, st['completion_tokens']))} |")
    goal = settings["goal_ratio"]
    verdicts = []
    for model, res in results.items():
        eng = res["summary"].get("engine", {}).get("decode_ratio_vs_inproc")
        if eng is not None:
            verdicts.append(f"{model}: engine {eng:.3f}× {'≥' if eng >= goal else '<'} {goal}× "
                            f"({'MET' if eng >= goal else 'NOT MET'})")
    if verdicts:
        lines += ["", "Goal (engine ≥ %.2f× in-process decode tok/s): " % goal + "; ".join(verdicts)]
    bg = max((st["background_cores_median"] for res in results.values() for st in res["summary"].values()),
             default=0.0)
    if bg > 0.2:
        lines += ["", f"Warning: other programs used up to {bg:.2f} of {info['cpu_count']} CPU cores (median per "
                      "run) while this ran; the tok/s figures are noisy. CPU µs/token is the steadier measure."]
    notes = [n for res in results.values() for n in res["notes"]]
    if notes:
        lines += [""] + [f"- note: {n}" for n in notes]
    return "\n".join(lines)


# --- the benchmark ----------------------------------------------------------------------------

def bench_model(name: str, model_path: Path, args: argparse.Namespace, ways: list[str]) -> dict[str, Any]:
    say(f"== model {name}: {model_path}")
    runners: dict[str, Any] = {}
    servers: list[Server] = []
    samples: list[Sample] = []
    ref_windows: dict[str, int] = {}
    discarded: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="mlxd-bench-") as tmp:
        workdir = Path(tmp)
        try:
            # Start the servers first: they load while this process loads its copy.
            started = time.monotonic()
            if "engine" in ways:
                servers.append(engine := start_engine(model_path, workdir))
            if "mlx_lm" in ways:
                servers.append(mlx_srv := start_mlx_lm(model_path, workdir, args.mlx_lm_prompt_cache))
            if "inproc" in ways:
                runners["inproc"] = InProcess(model_path)
            for srv in servers:
                srv.wait_ready(args.startup_timeout)
            if "engine" in ways:
                runners["engine"] = HttpWay("engine", engine.url, "default", engine)
            if "mlx_lm" in ways:
                runners["mlx_lm"] = HttpWay("mlx_lm", mlx_srv.url, "default_model", mlx_srv)
            say(f"   ready in {time.monotonic() - started:.1f}s "
                + " ".join(f"({s.name} pid {s.proc.pid})" for s in servers))

            plan = [(w, i, True) for i in range(args.warmup) for w in ways]
            for r in range(args.rounds):
                k = r % len(ways)  # rotate the starting way: no way always runs right after another
                plan += [(w, r, False) for w in ways[k:] + ways[:k]]
            total = len(plan)
            for n, (way, rnd, warm) in enumerate(plan, 1):
                runner = runners[way]
                if isinstance(runner, HttpWay) and runner.server.proc.poll() is not None:
                    raise BenchError(f"{runner.server.name} died (exit {runner.server.proc.returncode}):\n"
                                     f"{runner.server.log_tail()}")
                tries = 1 if warm or args.max_background is None else 1 + args.retries
                for attempt in range(tries):
                    s = to_sample(measure(runner, args.prompt, args.max_tokens), name, way, rnd, warm, ref_windows)
                    if attempt + 1 == tries or (s.background_cores or 0.0) <= args.max_background:
                        break
                    discarded.append(s)
                    say(f"   [{n:2d}/{total}] {name} {LABEL[way]}: background load {s.background_cores:.2f} cores > "
                        f"{args.max_background}: run discarded, retrying in 2s")
                    time.sleep(2.0)
                samples.append(s)
                if way == "inproc":
                    ref_windows[s.text_sha1] = s.decode_window_tokens
                tag = f"warmup {rnd + 1}/{args.warmup}" if warm else f"round {rnd + 1}/{args.rounds}"
                say(f"   [{n:2d}/{total}] {name} {tag:12s} {LABEL[way]:13s} TTFT {s.ttft_ms:7.1f} ms  "
                    f"decode {s.decode_tok_s:7.1f} tok/s  {s.prompt_tokens}+{s.completion_tokens} tok  "
                    f"{s.total_s:5.2f}s  CPU/tok {s.server_cpu_us_per_token:5.0f}+{s.client_cpu_us_per_token:3.0f} us"
                    f"  background {s.background_cores:.2f} cores")
        finally:
            for r in runners.values():
                r.close()
            for srv in servers:
                stop_child(srv.proc)
    measured = [s for s in samples if not s.warmup]
    notes = check_consistency(name, measured)
    for n in notes:
        say(f"   note: {n}")
    return {"model_path": str(model_path), "summary": summarize(samples, ways), "notes": notes,
            "samples": [asdict(s) for s in samples], "discarded_samples": [asdict(s) for s in discarded]}


def _variants() -> list[str]:
    from mlxd.engine.demo_model import VARIANTS

    return list(VARIANTS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", type=Path, metavar="PATH",
                   help="an mlx-lm model folder (repeatable); default: the demo models")
    p.add_argument("--variant", action="append", choices=_variants(),
                   help="demo model variant(s) to run when no --model is given (default: a and b)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where demo models are built ({DEFAULT_CACHE})")
    p.add_argument("--ways", default=",".join(WAYS),
                   help=f"comma-separated subset of {','.join(WAYS)} (default: all three)")
    p.add_argument("--rounds", type=int, help="measured rounds (default 7; --quick 3)")
    p.add_argument("--warmup", type=int, help="warmup runs per way (default 1)")
    p.add_argument("--max-tokens", type=int, help="tokens per run (default 256; --quick 128)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt string")
    p.add_argument("--quick", action="store_true", help="fewer, shorter runs (well under a minute)")
    p.add_argument("--mlx-lm-prompt-cache", action="store_true",
                   help="leave mlx_lm.server's prompt cache on (it then skips the prefill of a repeated prompt)")
    p.add_argument("--max-background", type=float, metavar="CORES",
                   help="re-run a measured run (up to --retries times) when other programs used more than CORES "
                        "CPU cores during it (default: keep every run)")
    p.add_argument("--retries", type=int, default=3, help="re-runs per run for --max-background (default 3)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for a server to become ready")
    p.add_argument("--goal", type=float, default=0.97, dest="goal_ratio", help="target engine/in-process ratio")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else 1
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (128 if args.quick else 256)
    if args.rounds < 1 or args.warmup < 0 or args.max_tokens < 2:
        p.error("need --rounds >= 1, --warmup >= 0, --max-tokens >= 2")
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    bad = [w for w in ways if w not in WAYS]
    if bad or not ways:
        p.error(f"--ways: unknown {bad} (choose from {','.join(WAYS)})")
    args.ways_list = [w for w in WAYS if w in ways]
    if args.model and args.variant:
        p.error("give --model or --variant, not both")
    return args


def models_to_run(args: argparse.Namespace) -> list[tuple[str, Path]]:
    if args.model:
        out = []
        for m in args.model:
            if not (m / "config.json").is_file():
                raise BenchError(f"{m} is not an mlx-lm model folder (no config.json)")
            out.append((m.resolve().name, m.resolve()))
        return out
    from mlxd.engine.demo_model import VARIANTS, build_demo_model

    out = []
    for v in args.variant or ["a", "b"]:
        dest = args.cache_dir / f"demo-{v}"
        say(f"demo model {v}: {dest}")
        build_demo_model(dest, v, progress=lambda m: say(f"   {m}"))
        spec = VARIANTS[v]
        out.append((f"demo-{v} ({spec.hidden_size}x{spec.num_hidden_layers})", dest))
    return out


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    settings = {"max_tokens": args.max_tokens, "rounds": args.rounds, "warmup": args.warmup,
                "ways": args.ways_list, "prompt": args.prompt, "sampling": {"temperature": 0.0},
                "endpoint": "/v1/completions (stream, include_usage)", "quick": args.quick,
                "mlx_lm_server_prompt_cache": args.mlx_lm_prompt_cache,
                "max_background_cores": args.max_background, "goal_ratio": args.goal_ratio,
                "metrics": {"ttft": "t0 (before the request is sent / before tokenizing) -> first chunk with "
                                    "non-empty text",
                            "decode_tok_s": "(window - 1) / (t_last - t_first), first/last chunk with non-empty "
                                            "text; window = tokens from the first to the last such chunk "
                                            "(= completion_tokens unless some have empty text)"}}
    started = time.monotonic()
    results: dict[str, Any] = {}
    try:
        info = machine_info()
        for name, path in models_to_run(args):
            results[name] = bench_model(name, path, args, args.ways_list)
    except KeyboardInterrupt:
        say("interrupted: stopping the servers")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        stop_all_children()
    settings["wall_s"] = round(time.monotonic() - started, 1)
    info["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "settings": settings, "results": results}, indent=1,
                                   allow_nan=True) + "\n")
    print(markdown(results, settings, info))
    say(f"\nraw samples: {args.out} (total {settings['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
