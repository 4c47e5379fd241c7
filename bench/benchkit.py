"""What the benchmarks share (bench/ is no package: each script puts this
folder on sys.path and imports it): the demo models and result files, the
streaming SSE client that timestamps every chunk, one run's trace and sample,
CPU accounting, server subprocesses stopped by pid, machine info, medians.

Metrics, identical for every benchmark that streams (see bench/README.md):
  TTFT            t0 -> first content-carrying chunk (non-empty text), where
                  t0 is just before the request is sent
  decode tok/s    (window - 1) / (t_last - t_first) over the first and last
                  content-carrying chunks; window = the tokens between them
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Sequence

import psutil
import requests

from mlxd.devkit.engine_process import ServerProcess, stop_by_pid
from mlxd.devkit.engine_process import spawn as spawn_server
from mlxd.devkit.engine_process import start_engine as devkit_start_engine
from mlxd.devkit.ports import free_port  # noqa: F401 - the benchmarks import it from here

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxd-bench"
# Chosen so that the greedy continuations of both demo models start and end
# with a token that has text (see "decode window" in bench/README.md).
DEFAULT_PROMPT = ("Tokens stream back one by one. The first token takes longest, because the prompt must be "
                  "processed; after that, every step is a small matrix product per layer.")

now = time.perf_counter


class BenchError(RuntimeError):
    """A benchmark cannot go on (a server died, a stream broke): reported, exit 1."""


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




def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


# --- the streaming client ------------------------------------------------------------

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


_PDEATHSIG = _child_setup if _PRCTL is not None else None


class Server(ServerProcess):
    """A server a benchmark started (mlxd.devkit.engine_process): `wait_ready`
    raises BenchError."""

    failure = BenchError


def _started(server: Server) -> Server:
    _children.append(server.proc)
    return server


def spawn(name: str, argv: list[str], env: dict[str, str], log_path: Path, port: int, health_path: str) -> Server:
    """`argv` as a server on `port`, stopped with the benchmark (stop_all_children)."""
    return _started(spawn_server(name, argv, env, log_path, port, health_path, preexec_fn=_PDEATHSIG, kind=Server))


def stream_chat(url: str, messages: list[dict], max_tokens: int, extra: dict | None = None,
                timeout: float = 600) -> dict[str, Any]:
    """One greedy streamed chat completion from an engine or gateway at `url`:
    {"started", "first" (the first chunk with text; None: none came), "end"
    (perf_counter times), "text", "usage"}."""
    started = time.perf_counter()
    first, text, usage = None, "", {}
    with requests.post(url + "/v1/chat/completions", stream=True, timeout=timeout, json={
            "model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            piece = "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
            if piece and first is None:
                first = time.perf_counter()
            text += piece
            usage = chunk.get("usage") or usage
    return {"started": started, "first": first, "end": time.perf_counter(), "text": text, "usage": usage}


def stop_child(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM by pid (the engine drains: it is idle, so that is quick), then SIGKILL."""
    stop_by_pid(proc, grace)
    if proc in _children:
        _children.remove(proc)


def stop_all_children() -> None:
    for proc in list(_children):
        try:
            stop_child(proc)
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            say(f"could not stop pid {proc.pid}: {exc}")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a server that is not mlxd's (mlx_lm.server): offline, unbuffered."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("MLXD_CONFIG", None)
    return env


def one_model_config(model: Path) -> dict[str, Any]:
    """An engine config serving `model` as "default" with no token cap (for
    start_engine, or mlxd.toml_text.dumps)."""
    # stuck_grace_s: a slow CPU's long prefill must not count as a hang here
    return {"engine": {"max_tokens_cap": 100000, "stuck_grace_s": 600},
            "models": {"bench": {"path": model.resolve()}}, "aliases": {"default": "bench"}}


def start_engine(home: Path, config: str | dict[str, Any] | None, log_path: Path, name: str = "mlxd engine", *,
                 port: int | None = None, env: dict[str, str | None] | None = None,
                 launcher: list[str] | None = None) -> Server:
    """`mlxd engine` alone (no supervisor) on `port` (a free one by default),
    `config` its mlxd.toml (text or values; None: the one in `home`, for a
    restart), `env` on top of its environment (None: unset), `launcher`
    before it (a rank group's); stopped with the benchmark (stop_all_children)."""
    return _started(devkit_start_engine(home, config, port=port, env=env, log_path=log_path, name=name,
                                        launcher=launcher or (), preexec_fn=_PDEATHSIG, kind=Server))


# --- machine info ------------------------------------------------------------------------

def version(dist: str) -> str | None:
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
        "mlx": version("mlx") or getattr(mx, "__version__", None),
        "mlx_device": str(mx.default_device()),
        "gpu": _gpu_name(),
        "mlx_lm": version("mlx-lm"),
        "http_stack": {d: version(d) for d in ("uvicorn", "h11", "httptools", "uvloop", "fastapi", "starlette",
                                                "requests", "urllib3")},
        "git": _git(),
    }


# --- statistics, demo models, results, signals ------------------------------------------

def chosen(p: Any, flag: str, text: str, choices: tuple[str, ...] | list[str]) -> list[str]:
    """A comma-separated flag's picks among `choices`, in their order;
    argparse's error for an unknown or empty pick."""
    picked = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in picked if x not in choices]
    if bad or not picked:
        p.error(f"{flag}: unknown {bad} (choose from {','.join(choices)})")
    return [c for c in choices if c in picked]


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header, then a row per list (numbers right-aligned)."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values` by nearest rank; None when empty."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]



def variants() -> list[str]:
    """The demo model variants (mlxd.engine.model.demo_model), for --variant."""
    from mlxd.engine.model.demo_model import VARIANTS

    return list(VARIANTS)


def demo_model(variant: str, cache_dir: Path = DEFAULT_CACHE) -> tuple[str, Path]:
    """(label with its shape, folder) of a demo model, built once into `cache_dir`."""
    from mlxd.engine.model.demo_model import VARIANTS, build_demo_model

    dest = cache_dir / f"demo-{variant}"
    say(f"demo model {variant}: {dest}")
    build_demo_model(dest, variant, progress=lambda m: say(f"   {m}"))
    spec = VARIANTS[variant]
    return f"demo-{variant} ({spec.hidden_size}x{spec.num_hidden_layers})", dest


def write_json(path: Path, doc: Any) -> None:
    """A benchmark's results file (its folder made as needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=True, default=str) + "\n")


def interrupt_on_sigterm() -> None:
    """SIGTERM stops a benchmark as Ctrl-C does: through its `finally`s."""
    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


# --- shared by the quality benchmarks (kv_quality.py, approx_reuse_quality.py) --------------

def first_difference(reference: Sequence[int], got: Sequence[int], n: int) -> int:
    """Tokens of `got` equal to the reference before the first that is not
    (n when the first n all agree; a `got` cut short counts as differing
    where it ends)."""
    for i in range(n):
        if i >= len(got) or i >= len(reference) or got[i] != reference[i]:
            return i
    return n


def mean_of(xs: Iterable[float | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def log_kl(p_log: Any, q_log: Any) -> Any:
    """KL(p || q) over the last axis of two log-probability arrays (MLX)."""
    import mlx.core as mx

    return mx.sum(mx.exp(p_log) * (p_log - q_log), axis=-1)


def compare_distributions(ref_first: Any, ref_forced: Any, first: Any, forced: Any) -> dict[str, Any]:
    """Distribution agreement with the reference: top-1 and KL(ref || arm),
    of the first generated token and over the N teacher-forced steps."""
    import mlx.core as mx

    kl = log_kl
    first = first.astype(mx.float32)
    ref_first = ref_first.astype(mx.float32)
    top1 = mx.argmax(forced, axis=-1) == mx.argmax(ref_forced, axis=-1)
    return {"first_top1": bool(mx.argmax(first).item() == mx.argmax(ref_first).item()),
            "first_kl": max(0.0, float(kl(ref_first, first).item())),
            "forced_top1": float(mx.mean(top1.astype(mx.float32)).item()),
            "forced_kl": max(0.0, float(mx.mean(kl(ref_forced, forced)).item()))}


def open_real_model(gguf: Path, weights: str) -> tuple[Any, Any, dict[str, Any]] | None:
    """A quality benchmark's start: OpenBLAS under MLX as the engine has it
    (before MLX is imported), SIGTERM as an interrupt, and the real default
    model's GGUF loaded (load_gguf_model), said on stderr; None, having said
    why, when set-up has not fetched the GGUF."""
    from mlxd.engine.cpu.fast_blas import activate

    activate()
    interrupt_on_sigterm()
    if not gguf.is_file():
        say(f"no GGUF at {gguf}: run ./scripts/setup.sh where the package registry is reachable")
        return None
    model, tokenizer, info = load_gguf_model(gguf, weights)
    say(f"model: {info['description']}; {info['blas']}")
    if weights == "float32" and not info["blas_fast"]:
        say("   slow: float32 on MLX's reference BLAS; ./scripts/setup.sh builds the OpenBLAS path (mlxd doctor)")
    return model, tokenizer, info


def load_gguf_model(gguf: Path, weights: str) -> tuple[Any, Any, dict[str, Any]]:
    """The GGUF converted as the engine converts it, loaded with mlx-lm;
    with weights="float32" every quantized layer dequantized to float32.
    engine/cpu/fast_blas.py's activate() must have run (main does it first)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    from mlxd.engine.cpu import fast_blas
    from mlxd.engine.model.gguf_convert import convert_gguf

    folder = convert_gguf(gguf, DEFAULT_CACHE / "gguf", say=lambda m: say(f"   {m}"))
    model, tokenizer = load(str(folder))
    if weights == "float32":
        # Scales and biases to float32 first: mx.dequantize computes w*scale+bias in
        # their dtype, so each weight is then exact rather than rounded to float16.
        model.set_dtype(mx.float32)
        model = dequantize_model(model)
    mx.eval(model.parameters())
    dtypes = sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())})
    blas = fast_blas.active()
    args = model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    info = {"gguf": str(gguf), "folder": str(folder), "weights": weights, "parameter_dtypes": dtypes,
            "kv_dtype": "float32" if weights == "float32" else "float16",
            "layers": len(model.layers), "kv_heads": args.num_key_value_heads, "head_dim": head_dim,
            "description": ("Q4_1 GGUF weights dequantized to float32 (w*scale+bias), float32 arithmetic"
                            if weights == "float32" else "Q4_1 GGUF weights as MLX affine 4-bit (group 32), "
                            "float16 scales/biases, MLX's quantized kernels"),
            "blas": blas.why if blas else "fast_blas.activate() not called: MLX's own BLAS",
            "blas_fast": bool(blas and blas.fast)}
    return model, tokenizer, info
