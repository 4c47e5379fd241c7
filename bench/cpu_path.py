#!/usr/bin/env python3
"""The fast CPU path (issue 26): the real default model on Linux CPU cores, before and after.

Each arm is a real `mlxd engine` process serving the default model's GGUF
(SmolLM2-135M-Instruct, Q4_1; `gguf = PATH` in its config, alias default):

  before     MLXD_CPU_BLAS=reference, [engine] cpu_float32 = false: MLX's reference BLAS, Q4_1 as stored
  blas-only  OpenBLAS under MLX (engine/cpu/fast_blas.py), cpu_float32 = false: Q4_1 with a fast BLAS
             (quantised matmuls are MLX's own kernels, not BLAS: this shows it)
  after      the defaults: OpenBLAS and the weights loaded as float32
  after-1t   (only with --arms) the defaults with OPENBLAS_NUM_THREADS=1
  after-stored  (only with --arms) the defaults with bench/cpu_arms.py's layout stored:
             mlx-lm's model as it is (Linear weights as MLX lays them out, MLX's ops for every step)
  after-transposed  (only with --arms) layout transposed: weights transposed where they widen
             (engine/cpu/cpu_linear.py) and the one-token shortcuts (engine/cpu/cpu_decode.py), a
             token on one stream (the default's layout, named)
  after-split  (only with --arms) layout split: every layer transposed, wide ones in
             column blocks on 2 CPU streams, a token's MLP a chain per stream

An arm with a layout runs its engine through this script (`--engine-layout
LAYOUT -- COMMAND`): the engine's BLAS chosen first, then bench/cpu_arms.py's
layout put in place of the engine's own float32 layout, then `mlxd engine`
in the same process. The engine itself has no setting for it.

Per arm, in rounds that alternate the arms (the first arm rotates each
round), medians over the rounds:
  prefill tok/s   prompt_tokens / TTFT of a ~512-token completion prompt with
                  max_tokens 1 (each round's prompt starts with its own number,
                  and the prompt cache is off: nothing is reused)
  decode tok/s    streamed, 128 tokens, temperature 0: (window - 1) /
                  (t_last - t_first) over the content-carrying chunks (benchkit)
  CPU             the engine's CPU seconds per decoded token, and the cores
                  it kept busy while decoding
and once per arm a ~2,000-token chat prompt (non-streamed), with the
default stuck_grace_s (30 s): answered 200 by the engine or not (503
engine_stuck is what the gateway answers with the fallback), its time, and
the engine's /health polled all along. The engine's own log says which BLAS
it used (engine/cpu/fast_blas.py) and whether it loaded the weights as float32.
`--profile` adds a micro-profile of one decode step at float32 (lm_head,
layers, memory read speed) in a child process, for "what limits decode".

Usage:
  .venv/bin/python bench/cpu_path.py --quick     # 1 round, shorter prompts: a few minutes on 2 cores
  .venv/bin/python bench/cpu_path.py             # 3 rounds, ~2,000-token prompt on every arm
  .venv/bin/python bench/cpu_path.py --arms before,after --rounds 5 --keep-logs

Progress goes to stderr, the Markdown table to stdout, everything to --out
(JSON, default bench/results/cpu_path.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
import requests

from mlxd.reports import EngineHealth
from mlxd.toml_text import dumps

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py, tests)
from benchkit import (RESULTS, BenchError, HttpWay, Server, busy_cpu_s, child_env, chosen, interrupt_on_sigterm,  # noqa: E402
                      machine_info, median, now, say, start_engine, stop_all_children, to_sample, write_json)

DEFAULT_OUT = RESULTS / "cpu_path.json"
GOAL_PREFILL_TOK_S = 120.0
GOAL_DECODE_TOK_S = 12.0
BLAS_ENV = "MLXD_CPU_BLAS"  # engine/cpu/fast_blas.py's OPT_OUT_ENV
BLAS_LOG_MARK = "MLX's CPU backend uses"  # the start of BlasChoice.why, logged at start
FLOAT32_LOG_MARK = "as float32"  # in the worker's "loaded ... in Xs (...)" line
LOADED_LOG = re.compile(r"\bloaded \S+ in ([0-9.]+)s \(MLX active")
STORY = "Once upon a time, in a small village by the sea, there lived"


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    fast_blas: bool  # False: MLXD_CPU_BLAS=reference
    cpu_float32: bool
    env: tuple[tuple[str, str], ...] = ()
    layout: str | None = None  # bench/cpu_arms.py's layout in place of the engine's (None: the engine's own)


ARMS = {
    "before": Arm("before", "reference BLAS, Q4_1", False, False),
    "blas-only": Arm("blas-only", "OpenBLAS, Q4_1", True, False),
    "after": Arm("after", "OpenBLAS, float32 (the defaults)", True, True),
    "after-1t": Arm("after-1t", "OpenBLAS 1 thread, float32", True, True, (("OPENBLAS_NUM_THREADS", "1"),)),
    "after-stored": Arm("after-stored", "OpenBLAS, float32, mlx-lm's model as it is (x @ W.T)", True, True,
                        layout="stored"),
    "after-transposed": Arm("after-transposed", "OpenBLAS, float32, transposed + shortcuts, one stream", True, True,
                            layout="transposed"),
    "after-split": Arm("after-split", "OpenBLAS, float32, transposed + shortcuts, wide layers on 2 streams", True,
                       True, layout="split"),
}
ENGINE_LAYOUT = "--engine-layout"  # main()'s mode for an arm's engine: `--engine-layout LAYOUT -- COMMAND`
DEFAULT_ARMS = ("before", "blas-only", "after")


def arm_env_changes(arm: Arm) -> dict[str, str | None]:
    """What the arm sets in the engine's environment (None: unset, whatever
    this process was started with): the opt-out for the reference arm only."""
    return {BLAS_ENV: None if arm.fast_blas else "reference", "OPENBLAS_NUM_THREADS": None, **dict(arm.env)}


def arm_env(arm: Arm, base: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: `base` (this process's) with the arm's changes."""
    env = {**(child_env() if base is None else base), **arm_env_changes(arm)}
    return {k: v for k, v in env.items() if v is not None}


def engine_launcher(arm: Arm) -> list[str]:
    """What goes before `python -m mlxd.cli engine ...` (benchkit's
    start_engine): this script's --engine-layout mode for an arm with a
    layout, nothing for the others."""
    if arm.layout is None:
        return []
    return [sys.executable, str(Path(__file__).resolve()), ENGINE_LAYOUT, arm.layout, "--"]


def engine_with_layout(layout: str, command: list[str]) -> int:
    """`mlxd engine` in this process (command: `PYTHON -m mlxd.cli engine
    ...`, what start_engine runs) with bench/cpu_arms.py's `layout` in place
    of the engine's own float32 layout. The BLAS is chosen first, as the
    engine does, since bench/cpu_arms.py imports MLX."""
    if command[1:3] != ["-m", "mlxd.cli"] or len(command) < 4:
        raise SystemExit(f"{ENGINE_LAYOUT}: expected LAYOUT -- PYTHON -m mlxd.cli ..., got {command}")
    from mlxd.engine.cpu.fast_blas import activate

    activate()  # before MLX is imported (the engine's own call later returns this choice)
    import cpu_arms

    cpu_arms.install(layout)
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != Path(here)]  # no benchmark shadows a module
    from mlxd.cli.main import main as mlxd_main

    return mlxd_main(command[3:])


def engine_toml(gguf: Path, arm: Arm) -> str:
    """One model, the default model's GGUF as the alias default; the arm's
    cpu_float32; the prompt cache off (every prompt is prefilled); every
    other setting the engine's default (stuck_grace_s 30 among them)."""
    return dumps({"engine": {"cpu_float32": arm.cpu_float32, "prompt_cache": {"enabled": False}},
                  "models": {"smollm2": {"gguf": gguf.resolve()}}, "aliases": {"default": "smollm2"}})


def parse_engine_log(text: str) -> dict[str, Any]:
    """What the engine said about its CPU path (pure): the BLAS line, and
    whether (and how fast) the model loaded as float32."""
    lines = text.splitlines()
    blas = next((ln for ln in lines if BLAS_LOG_MARK in ln), None)
    loaded = next((ln for ln in lines if LOADED_LOG.search(ln)), None)
    m = LOADED_LOG.search(loaded) if loaded else None

    def message(line: str | None) -> str | None:  # without the time, level and logger
        return line.split(": ", 1)[1] if line and ": " in line else line

    return {"blas_log": message(blas), "blas_fast": bool(blas) and "reference BLAS" not in blas,
            "loaded_log": message(loaded), "float32": bool(loaded) and FLOAT32_LOG_MARK in loaded,
            "load_s": float(m.group(1)) if m else None}


# --- prompts ----------------------------------------------------------------------------------

_WHO = ["The harbour master", "A young engineer", "The village baker", "An old fisherman", "The librarian",
        "A travelling merchant", "The schoolteacher", "Our neighbour", "The lighthouse keeper", "A quiet student"]
_DID = ["repaired", "painted", "measured", "described", "counted", "cleaned", "moved", "photographed", "sold",
        "mapped"]
_WHAT = ["the wooden bridge", "a row of blue boats", "the stone wall by the church", "three baskets of apples",
         "the clock on the market hall", "a map of the northern coast", "the narrow road to the hills",
         "an old brass telescope", "the garden behind the school", "a crate of glass bottles"]
_WHEN = ["before sunrise", "on a rainy Tuesday", "after the storm", "in late autumn", "during the festival",
         "at noon", "one cold evening", "last spring", "on the first day of the month", "while the tide was out"]


def filler(seed: int, n_tokens: int, count: Callable[[str], int], lead: str = "") -> str:
    """Numbered plain sentences, `lead` first, as many as fit `n_tokens`
    (deterministic: every arm gets the same text for the same seed)."""
    rng = random.Random(seed)
    text, i = lead, 1
    while True:
        line = (f"{i}. {rng.choice(_WHO)} {rng.choice(_DID)} {rng.choice(_WHAT)} {rng.choice(_WHEN)}.\n")
        if count(text + line) > n_tokens and i > 1:
            return text
        text += line
        i += 1


def prefill_prompt(k: int, n_tokens: int, count: Callable[[str], int]) -> str:
    """Prompt k: its own leading number, so no prompt shares a first token
    with another (no prefix could be reused, even with a prompt cache)."""
    return filler(k, n_tokens, count, lead=f"Log {1000 + 37 * k}. Notes from the village:\n")


def long_messages(k: int, n_tokens: int, count: Callable[[str], int]) -> list[dict[str, str]]:
    """A chat of about `n_tokens` (the template adds a few dozen): a long
    system prompt of notes, then a short question."""
    system = filler(10_000 + k, max(n_tokens - 40, 16), count,
                    lead=f"You answer questions about these notes (set {k}). Notes:\n")
    return [{"role": "system", "content": system},
            {"role": "user", "content": "Which note mentions the lighthouse keeper? Answer in one sentence."}]


def token_counter(homes: list[Path]) -> Callable[[str], int]:
    """Token counts by the model's own tokenizer, from the folder an engine
    converted the GGUF into; else ~4 characters a token."""
    from tokenizers import Tokenizer

    for home in homes:
        for tok in sorted((home / "models" / "gguf").glob("*/tokenizer.json")):
            t = Tokenizer.from_file(str(tok))
            return lambda text: len(t.encode(text).ids)
    say("   note: no converted tokenizer found; counting ~4 characters a token")
    return lambda text: max(1, len(text) // 4)


# --- one arm's engine -------------------------------------------------------------------------

@dataclass
class ArmRun:
    arm: Arm
    server: Server
    home: Path
    way: HttpWay
    engine: dict[str, Any] = field(default_factory=dict)  # what its log and /health said
    warmup: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    long: dict | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.server.proc.poll() is None


def start_arm(arm: Arm, gguf: Path, workdir: Path) -> ArmRun:
    """benchkit's start_engine (`mlxd engine` alone on a free port, the
    config in a fresh MLXD_HOME) with the arm's environment."""
    home = workdir / arm.name / "home"
    srv = start_engine(home, engine_toml(gguf, arm), workdir / arm.name / "engine.log", f"engine ({arm.name})",
                       env=arm_env_changes(arm), launcher=engine_launcher(arm))
    return ArmRun(arm, srv, home, HttpWay(arm.name, srv.url, "default", srv))


def measured(run: ArmRun, fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """fn() with CPU accounting: the engine's CPU seconds, this process's,
    and the rest of the machine's (background cores)."""
    proc = psutil.Process(run.server.proc.pid)
    busy0, wall0, srv0, me0 = busy_cpu_s(), now(), sum(proc.cpu_times()[:2]), time.process_time()
    out = fn()
    srv, me, wall = sum(proc.cpu_times()[:2]) - srv0, time.process_time() - me0, now() - wall0
    busy = busy_cpu_s() - busy0
    return out, {"engine_cpu_s": srv, "client_cpu_s": me, "wall_s": wall,
                 "background_cores": max(0.0, busy - srv - me) / wall if wall > 0 else 0.0}


def check_alive(run: ArmRun) -> None:
    if not run.alive:
        raise BenchError(f"{run.server.name} exited with {run.server.proc.returncode}:\n{run.server.log_tail()}")


def run_prefill(run: ArmRun, prompt: str, rnd: int, read_timeout: float) -> dict:
    check_alive(run)
    tr, cpu = measured(run, lambda: run.way.run(prompt, 1, read_timeout))
    first = tr.chunk_times[0] if tr.chunk_times else tr.t_end  # a first token without text: the stream's end
    ttft = first - tr.t0
    return {"round": rnd, "prompt_tokens": tr.prompt_tokens, "cached_prompt_tokens": tr.cached_prompt_tokens,
            "ttft_s": ttft, "prefill_tok_s": tr.prompt_tokens / ttft if ttft > 0 else float("nan"),
            "completion_tokens": tr.completion_tokens, **cpu}


def run_decode(run: ArmRun, prompt: str, max_tokens: int, rnd: int, read_timeout: float) -> dict:
    check_alive(run)
    tr, cpu = measured(run, lambda: run.way.run(prompt, max_tokens, read_timeout))
    s = to_sample(tr, "default", run.arm.name, rnd, False, {})
    n = max(tr.completion_tokens, 1)
    return {"round": rnd, "decode_tok_s": s.decode_tok_s, "ttft_s": s.ttft_ms / 1e3,
            "completion_tokens": tr.completion_tokens, "decode_window_tokens": s.decode_window_tokens,
            "prompt_tokens": tr.prompt_tokens, "finish_reason": tr.finish_reason, "text_sha1": s.text_sha1,
            "engine_cpu_s_per_token": cpu["engine_cpu_s"] / n,
            "engine_cores": cpu["engine_cpu_s"] / cpu["wall_s"] if cpu["wall_s"] > 0 else float("nan"),
            "text_head": tr.text[:80], **cpu}


class HealthWatch(threading.Thread):
    """GET /health every `interval` s while a long request runs: did the
    engine ever say it was not ok (a supervisor would restart it)?"""

    def __init__(self, url: str, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.stop = threading.Event()
        self.polls = 0
        self.not_ok: list[dict] = []  # (seconds in, code, status, reason)
        self.failed = 0  # no answer within the poll's timeout
        self.t0 = now()

    def run(self) -> None:
        with requests.Session() as s:
            while not self.stop.wait(self.interval):
                try:
                    r = s.get(self.url + "/health", timeout=5)
                    self.polls += 1
                    if r.status_code != 200:
                        json_body = r.headers.get("content-type", "").startswith("application/json")
                        h = EngineHealth.from_json(r.json()) if json_body else None
                        self.not_ok.append({"t_s": round(now() - self.t0, 2), "code": r.status_code,
                                            "status": h.status if h else None, "reason": h.reason if h else None})
                except requests.RequestException:
                    self.failed += 1


def run_long(run: ArmRun, messages: list[dict], max_tokens: int, read_timeout: float) -> dict:
    """The long chat prompt, not streamed: the HTTP status is the outcome."""
    check_alive(run)
    watch = HealthWatch(run.server.url)
    watch.start()
    payload = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    try:
        t0 = now()
        r, cpu = measured(run, lambda: requests.post(run.server.url + "/v1/chat/completions", json=payload,
                                                     timeout=(10, read_timeout)))
        elapsed = now() - t0
    except requests.RequestException as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}", "answered_by_engine": False,
                "health_not_ok": watch.not_ok, "health_polls": watch.polls}
    finally:
        watch.stop.set()
        watch.join(10)
    try:
        body = r.json()
    except ValueError:
        body = {}
    usage = body.get("usage") or {}
    err = body.get("error") or {}
    text = ((body.get("choices") or [{}])[0].get("message") or {}).get("content") if r.status_code == 200 else None
    prompt_tokens = usage.get("prompt_tokens")
    return {"status": r.status_code, "answered_by_engine": r.status_code == 200, "time_s": elapsed,
            "prompt_tokens": prompt_tokens, "completion_tokens": usage.get("completion_tokens"),
            "prompt_tok_s_incl_decode": prompt_tokens / elapsed if prompt_tokens and elapsed > 0 else None,
            "error_code": err.get("code") if isinstance(err, dict) else None,
            "error": (err.get("message") if isinstance(err, dict) else str(err))[:300] if err else None,
            "text_head": (text or "")[:120], "health_polls": watch.polls, "health_not_ok": watch.not_ok,
            "health_poll_failures": watch.failed, "engine_alive_after": run.alive, **cpu}


def engine_facts(run: ArmRun) -> dict[str, Any]:
    """The log's BLAS and float32 lines, and /health's memory and load time."""
    facts = parse_engine_log(run.server.log_path.read_text(errors="replace"))
    try:
        h = EngineHealth.from_json(requests.get(run.server.url + "/health", timeout=5).json())
        if h is not None:
            facts["mlx_active_mib"] = round((h.memory.mlx_active_bytes if h.memory else 0) / 2**20, 1)
            facts["last_load_s"] = h.timings.get("last_load_s")
            facts["resident_model"] = h.resident_model
    except (requests.RequestException, ValueError):
        pass
    return facts


# --- the micro-profile (a child process: its BLAS is chosen before MLX loads) -------------------

def profile_child(folder: str, dtype: str, steps: int) -> dict[str, Any]:
    """One decode step of the model at `dtype` ("float32" or "stored"),
    loaded as the engine loads it, and its parts (lm_head; one layer x the
    layers); what memory gives (numpy sums on every core) and what the BLAS
    gives a matrix-vector product (x @ W.T, mlx's Linear, and x @ W)."""
    import statistics

    from mlxd.engine.cpu.fast_blas import activate

    blas = activate()  # before MLX is imported
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine.model.model_load import load_resident

    resident = load_resident("profile", folder, None if dtype == "stored" else dtype)
    model, tokenizer = resident.model, resident.tokenizer

    def timed(fn: Callable[[], Any], n: int) -> tuple[float, float]:
        fn()
        fn()
        ts, c0, w0 = [], time.process_time(), time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts), (time.process_time() - c0) / (time.perf_counter() - w0)

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokenizer.encode(STORY))[None], cache=cache))
    tok = mx.array([[tokenizer.encode(" the")[-1]]])
    step_s, step_cores = timed(lambda: mx.eval(model(tok, cache=cache)), steps)
    inner = model.model
    h = inner.embed_tokens(tok)
    tied = getattr(model.args, "tie_word_embeddings", True) or not hasattr(model, "lm_head")
    head = inner.embed_tokens.as_linear if tied else model.lm_head
    head_s, head_cores = timed(lambda: mx.eval(head(h)), steps)
    layer_s, layer_cores = timed(lambda: mx.eval(inner.layers[0](h, mask=None, cache=None)), steps)
    params = dict(tree_flatten(model.parameters()))
    weight_bytes = sum(v.nbytes for v in params.values())
    embed_bytes = sum(v.nbytes for k, v in params.items() if k.startswith("model.embed_tokens."))
    # Read per token: every weight once (a tied embedding is the lm_head: read
    # whole there; untied, the embedding gives one row).
    per_token = weight_bytes if tied else weight_bytes - embed_bytes
    n_layers = len(inner.layers)
    del cache, resident, model, inner, params
    # What memory gives: numpy sums over 512 MiB on every core at once.
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(128 * 2**20, np.float32)
    parts = np.array_split(a, os.cpu_count() or 1)
    with ThreadPoolExecutor(len(parts)) as pool:
        mem_s, _ = timed(lambda: list(pool.map(np.sum, parts)), 5)
    mem_bps = a.nbytes / mem_s
    del a, parts
    # What the BLAS gives a matrix-vector product of 512 MiB of float32: in
    # the layout of mlx's Linear (x @ W.T, the weights as stored) and the other.
    w = mx.ones((16384, 8192), mx.float32)
    x_in, x_out = mx.ones((1, 8192), mx.float32), mx.ones((1, 16384), mx.float32)
    mx.eval(w, x_in, x_out)
    nt_s, nt_cores = timed(lambda: mx.eval(x_in @ w.T), 5)
    nn_s, _ = timed(lambda: mx.eval(x_out @ w), 5)
    return {"blas": blas.name, "weights_dtype": dtype, "steps": steps, "step_ms": step_s * 1e3,
            "step_cores": step_cores, "tok_s": 1 / step_s, "lm_head_ms": head_s * 1e3, "lm_head_cores": head_cores,
            "lm_head_share": head_s / step_s, "layer_ms": layer_s * 1e3, "layers": n_layers,
            "layers_ms": layer_s * n_layers * 1e3, "layers_share": layer_s * n_layers / step_s,
            "tied_embeddings": bool(tied), "weight_bytes": weight_bytes, "bytes_per_token": per_token,
            "achieved_read_gb_s": per_token / step_s / 1e9, "memory_read_gb_s": mem_bps / 1e9,
            "memory_read_threads": os.cpu_count(), "blas_gemv_gb_s": w.nbytes / nt_s / 1e9,
            "blas_gemv_cores": nt_cores, "blas_gemv_nn_gb_s": w.nbytes / nn_s / 1e9,
            "bandwidth_bound_tok_s": mem_bps / per_token, "blas_gemv_bound_tok_s": w.nbytes / nt_s / per_token}


PROFILES = (("float32, OpenBLAS threads as configured", "float32", ()),
            ("float32, OPENBLAS_NUM_THREADS=1", "float32", (("OPENBLAS_NUM_THREADS", "1"),)))


def run_profiles(folder: Path, steps: int, timeout: float) -> list[dict]:
    out = []
    for label, dtype, extra in PROFILES:
        env = arm_env(ARMS["after"])
        env.update(dict(extra))
        say(f"   profile: {label}")
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--profile-child", str(folder),
                                   dtype, str(steps)], env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            out.append({"label": label, "error": f"timed out after {timeout:.0f}s"})
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            out.append({"label": label, "error": (proc.stderr or proc.stdout).strip()[-500:]})
            continue
        doc = json.loads(lines[-1])
        doc["label"] = label
        say(f"      step {doc['step_ms']:.1f} ms ({doc['tok_s']:.1f} tok/s, {doc['step_cores']:.2f} cores), lm_head "
            f"{doc['lm_head_ms']:.1f} ms ({doc['lm_head_share']:.0%}), {doc['layers']} layers "
            f"{doc['layers_ms']:.1f} ms; weights read at {doc['achieved_read_gb_s']:.2f} GB/s; the BLAS's x @ W.T "
            f"{doc['blas_gemv_gb_s']:.2f} GB/s (x @ W {doc['blas_gemv_nn_gb_s']:.2f}); memory "
            f"{doc['memory_read_gb_s']:.2f} GB/s")
        out.append(doc)
    return out


def decode_limit(profiles: list[dict], summary: dict[str, dict]) -> str:
    """One sentence on what limits decode, from the profile (pure)."""
    ok = [p for p in profiles if "error" not in p]
    after = summary.get("after") or {}
    cores = after.get("decode_engine_cores_median")
    if not ok:
        return "" if cores is None else (f"the engine keeps {cores:.2f} cores busy while decoding "
                                         "(--profile for a breakdown)")
    best = min(ok, key=lambda p: p["step_ms"])
    got, mem, gemv = best["achieved_read_gb_s"], best["memory_read_gb_s"], best["blas_gemv_gb_s"]
    out = (f"a float32 decode step reads every weight once, {best['bytes_per_token'] / 1e6:.0f} MB "
           f"({'the tied embedding is the lm_head' if best['tied_embeddings'] else 'untied lm_head'}); at best "
           f"({best['label']}) a step took {best['step_ms']:.0f} ms in-process ({best['tok_s']:.1f} tok/s, "
           f"{best['step_cores']:.2f} cores busy): {got:.1f} GB/s of weights, where memory gives {mem:.1f} GB/s "
           f"on {best['memory_read_threads']} cores (bound {best['bandwidth_bound_tok_s']:.0f} tok/s) and the "
           f"BLAS's matrix-vector product in mlx's Linear layout (x @ W.T) {gemv:.1f} GB/s (bound "
           f"{best['blas_gemv_bound_tok_s']:.1f} tok/s; x @ W: {best['blas_gemv_nn_gb_s']:.1f} GB/s). ")
    if got >= 0.7 * mem:
        out += "Limit: memory bandwidth"
    elif got >= 0.6 * gemv:
        out += (f"Limit: the BLAS's matrix-vector speed (M=1 sgemm, B transposed), {gemv / mem:.0%} of what memory "
                "gives")
    else:
        out += "Limit: per-op work beyond the matmuls (the BLAS and memory would allow more)"
    out += f"; the lm_head alone is {best['lm_head_share']:.0%} of a step"
    worst = max(ok, key=lambda p: p["step_ms"])
    if worst is not best and worst["step_ms"] > 1.3 * best["step_ms"]:
        out += (f"; with {worst['label'].split(', ', 1)[-1]} a step took {worst['step_ms']:.0f} ms "
                f"({worst['tok_s']:.1f} tok/s)")
    return out


# --- statistics and output ----------------------------------------------------------------------

def summarize(runs: dict[str, ArmRun]) -> dict[str, dict]:
    out = {}
    for name, r in runs.items():
        pre = [x["prefill_tok_s"] for x in r.prefill]
        dec = [x["decode_tok_s"] for x in r.decode]
        st: dict[str, Any] = {"rounds": len(r.prefill)}
        if pre:
            st.update(prefill_tok_s_median=median(pre), prefill_tok_s_min=min(pre), prefill_tok_s_max=max(pre),
                      prefill_ttft_s_median=median([x["ttft_s"] for x in r.prefill]),
                      prompt_tokens=sorted({x["prompt_tokens"] for x in r.prefill}),
                      cached_prompt_tokens_max=max((x["cached_prompt_tokens"] or 0) for x in r.prefill))
        if dec:
            st.update(decode_tok_s_median=median(dec), decode_tok_s_min=min(dec), decode_tok_s_max=max(dec),
                      decode_cpu_s_per_token_median=median([x["engine_cpu_s_per_token"] for x in r.decode]),
                      decode_engine_cores_median=median([x["engine_cores"] for x in r.decode]),
                      completion_tokens=sorted({x["completion_tokens"] for x in r.decode}))
        bg = [x["background_cores"] for x in r.prefill + r.decode]
        if bg:
            st["background_cores_median"] = median(bg)
        out[name] = st
    return out


def compare(runs: dict[str, ArmRun], summary: dict[str, dict], base: str = "before") -> dict[str, dict]:
    """Each arm against `base`: ratio of medians and the median of per-round
    (paired) ratios (steadier when the machine's speed drifts)."""
    if base not in runs:
        return {}
    out = {}
    for name, r in runs.items():
        if name == base:
            continue
        c = {}
        for key, rows, base_rows in (("prefill_tok_s", r.prefill, runs[base].prefill),
                                     ("decode_tok_s", r.decode, runs[base].decode)):
            a, b = summary[name].get(f"{key}_median"), summary[base].get(f"{key}_median")
            if a is None or b is None or not b:
                continue
            by_round = {x["round"]: x[key] for x in base_rows}
            paired = [x[key] / by_round[x["round"]] for x in rows if by_round.get(x["round"])]
            c[f"{key}_ratio"] = a / b
            c[f"{key}_ratio_paired"] = median(paired) if paired else None
        out[name] = c
    return out


def goals(summary: dict[str, dict], runs: dict[str, ArmRun], arm: str = "after") -> list[dict]:
    st = summary.get(arm) or {}
    out = []
    pre, dec = st.get("prefill_tok_s_median"), st.get("decode_tok_s_median")
    out.append({"goal": f"{arm}: prefill ≥ {GOAL_PREFILL_TOK_S:g} tok/s", "value": pre,
                "met": None if pre is None else pre >= GOAL_PREFILL_TOK_S})
    out.append({"goal": f"{arm}: decode ≥ {GOAL_DECODE_TOK_S:g} tok/s", "value": dec,
                "met": None if dec is None else dec >= GOAL_DECODE_TOK_S})
    for name, r in runs.items():
        if r.long is not None:
            out.append({"goal": f"{name}: the ~2,000-token prompt answered 200 by the engine",
                        "value": r.long.get("status"),
                        "met": bool(r.long.get("answered_by_engine")) and not r.long.get("health_not_ok")})
    return out


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "—" if x is None or (isinstance(x, float) and x != x) else fmt.format(x)


def markdown(doc: dict) -> str:
    info, settings, res = doc["machine"], doc["settings"], doc["results"]
    summ, comp = res["summary"], res["comparison"]
    lines = [f"### CPU path (issue 26) — {info['date']}{' (quick)' if settings['quick'] else ''}", "",
             f"{info['platform']}, {info['cpu_count']} CPUs ({info['cpu'] or '?'}), Python {info['python']}, "
             f"mlx {info['mlx']} ({info['mlx_device']}), mlx-lm {info['mlx_lm']}; model {settings['model']}. "
             f"{settings['rounds']} round(s), arms alternating, medians (min–max). prefill = prompt tokens / TTFT "
             f"(~{settings['prompt_tokens']}-token prompt, max_tokens 1, prompt cache off); decode = streamed "
             f"{settings['max_tokens']} tokens, greedy, (window−1)/(t_last−t_first); CPU = the engine's CPU s per "
             "decoded token (cores busy); background = cores other programs used meanwhile (median).", "",
             "| arm | BLAS (engine's log) | weights | prefill tok/s | × before | decode tok/s | × before | "
             "decode CPU s/token | ~2k-token prompt | background cores |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for name, a in res["arms"].items():
        st, c, eng = summ.get(name, {}), comp.get(name, {}), a["engine"]
        blas = eng.get("blas_log") or "?"
        blas = blas.split(" (/")[0].replace("MLX's CPU backend uses ", "").replace("its reference", "reference")
        blas = blas.split(": prompts")[0]
        weights = "float32" if eng.get("float32") else "as stored (Q4_1)"
        if eng.get("mlx_active_mib"):
            weights += f", {eng['mlx_active_mib']:.0f} MiB"
        pre = (f"{_f(st.get('prefill_tok_s_median'))} ({_f(st.get('prefill_tok_s_min'))}–"
               f"{_f(st.get('prefill_tok_s_max'))})") if "prefill_tok_s_median" in st else "—"
        dec = (f"{_f(st.get('decode_tok_s_median'))} ({_f(st.get('decode_tok_s_min'))}–"
               f"{_f(st.get('decode_tok_s_max'))})") if "decode_tok_s_median" in st else "—"

        def ratio(key: str) -> str:
            if name == "before":
                return "1.00"
            r, p = c.get(f"{key}_ratio"), c.get(f"{key}_ratio_paired")
            return "—" if r is None else f"**{r:.2f}×**" + (f" (paired {p:.2f})" if p is not None else "")
        cpu = (f"{_f(st.get('decode_cpu_s_per_token_median'), '{:.3f}')} "
               f"({_f(st.get('decode_engine_cores_median'), '{:.2f}')})") if "decode_tok_s_median" in st else "—"
        lg = a.get("long")
        if lg is None:
            long_s = "not run"
        elif lg.get("answered_by_engine"):
            long_s = f"200 in {lg['time_s']:.1f} s ({lg.get('prompt_tokens')} tok)"
            if lg.get("health_not_ok"):
                long_s += f"; /health not ok {len(lg['health_not_ok'])}×"
        else:
            long_s = f"**{lg.get('status')} {lg.get('error_code') or lg.get('error') or ''}**"
        lines.append(f"| {name} | {blas} | {weights} | {pre} | {ratio('prefill_tok_s')} | {dec} | "
                     f"{ratio('decode_tok_s')} | {cpu} | {long_s} | "
                     f"{_f(st.get('background_cores_median'), '{:.2f}')} |")
    lines += ["", "Goals: " + "; ".join(
        f"{g['goal']}: {'MET' if g['met'] else ('not measured' if g['met'] is None else 'NOT MET')}"
        + (f" ({g['value']:.1f})" if isinstance(g["value"], float) else "") for g in res["goals"])]
    if res.get("decode_limit"):
        lines += ["", f"What limits decode: {res['decode_limit']}."]
    profiles = [p for p in res.get("profile") or [] if "error" not in p]
    if profiles:
        lines += ["", "| micro-profile (in-process, one decode step) | step ms | tok/s | cores | lm_head ms (share) | "
                      "layers ms (share) | weights read GB/s | BLAS x@Wᵀ GB/s | BLAS x@W GB/s | memory GB/s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in profiles:
            lines.append(f"| {p['label']} ({p['blas']}) | {p['step_ms']:.1f} | {p['tok_s']:.1f} | "
                         f"{p['step_cores']:.2f} | {p['lm_head_ms']:.1f} ({p['lm_head_share']:.0%}) | "
                         f"{p['layers_ms']:.1f} ({p['layers_share']:.0%}) | {p['achieved_read_gb_s']:.2f} | "
                         f"{p['blas_gemv_gb_s']:.2f} | {p['blas_gemv_nn_gb_s']:.2f} | {p['memory_read_gb_s']:.2f} |")
    bg = max((st.get("background_cores_median", 0.0) for st in summ.values()), default=0.0)
    if bg > 0.2:
        lines += ["", f"Warning: other programs used {bg:.2f} of {info['cpu_count']} CPU cores (median per run, the "
                      "busiest arm) while this ran: the tok/s figures are low and noisy."]
    for n in res.get("notes") or []:
        lines.append(f"- note: {n}")
    return "\n".join(lines)


# --- the benchmark --------------------------------------------------------------------------------

def fast_path_probe() -> dict[str, Any]:
    """What engine/cpu/fast_blas.py's activate() chooses here, in a fresh
    process without the opt-out (the machine's fast path, if it has one)."""
    code = ("import json; from mlxd.engine.cpu.fast_blas import activate; c = activate(); "
            "print(json.dumps({'name': c.name, 'path': c.path, 'fast': c.fast, 'why': c.why}))")
    env = arm_env(ARMS["after"])
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, IndexError, ValueError) as exc:
        return {"name": None, "fast": None, "why": f"probe failed: {exc}"}


def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    arms = [ARMS[a] for a in args.arms_list]
    runs: dict[str, ArmRun] = {}
    notes: list[str] = []
    started = time.monotonic()
    for arm in arms:  # all at once: they load while the others load
        runs[arm.name] = start_arm(arm, args.gguf, workdir)
    for r in runs.values():
        r.server.wait_ready(args.startup_timeout)
    say(f"   engines ready in {time.monotonic() - started:.1f}s: "
        + ", ".join(f"{n} (pid {r.server.proc.pid})" for n, r in runs.items()))
    count = token_counter([r.home for r in runs.values()])
    timeout = args.read_timeout

    def attempt(r: ArmRun, what: str, fn: Callable[[], dict]) -> dict | None:
        if r.errors and not r.alive:
            return None
        try:
            return fn()
        except (BenchError, requests.RequestException) as exc:
            r.errors.append(f"{what}: {exc}")
            say(f"   {r.arm.name} {what}: FAILED: {str(exc)[:300]}")
            return None

    warm_prompt = prefill_prompt(-1, 48, count)
    for name, r in runs.items():
        for w in range(args.warmup):
            x = attempt(r, "warmup", lambda: run_decode(r, warm_prompt, 4, -1 - w, timeout))
            if x:
                r.warmup.append(x)
                say(f"   {name:9s} warmup  {x['prompt_tokens']}+{x['completion_tokens']} tok in {x['wall_s']:.1f}s")
        r.engine = engine_facts(r)
        say(f"   {name:9s} engine: {r.engine.get('blas_log') or 'no BLAS line in its log'}; "
            f"{'float32' if r.engine.get('float32') else 'as stored'}; MLX active "
            f"{r.engine.get('mlx_active_mib')} MiB; load {r.engine.get('load_s')}s")

    names = list(runs)
    for rnd in range(args.rounds):
        k = rnd % len(names)
        prompt = prefill_prompt(rnd, args.prompt_tokens, count)
        decode_prompt = f"Story {rnd + 1}. {STORY}"
        for name in names[k:] + names[:k]:
            r = runs[name]
            p = attempt(r, f"prefill round {rnd + 1}", lambda: run_prefill(r, prompt, rnd, timeout))
            if p:
                r.prefill.append(p)
                say(f"   [{rnd + 1}/{args.rounds}] {name:9s} prefill {p['prefill_tok_s']:7.1f} tok/s  "
                    f"({p['prompt_tokens']} tok, TTFT {p['ttft_s']:.2f}s)  background {p['background_cores']:.2f}")
            d = attempt(r, f"decode round {rnd + 1}", lambda: run_decode(r, decode_prompt, args.max_tokens, rnd,
                                                                         timeout))
            if d:
                r.decode.append(d)
                say(f"   [{rnd + 1}/{args.rounds}] {name:9s} decode  {d['decode_tok_s']:7.1f} tok/s  "
                    f"({d['completion_tokens']} tok, {d['engine_cpu_s_per_token']:.3f} CPU s/tok, "
                    f"{d['engine_cores']:.2f} cores)  background {d['background_cores']:.2f}")

    if args.long_tokens > 0:
        for name in [n for n in names if n in args.long_arms_list]:
            r = runs[name]
            say(f"   {name:9s} ~{args.long_tokens}-token prompt (stuck_grace_s 30) ...")
            messages = long_messages(names.index(name), args.long_tokens, count)
            x = attempt(r, "long prompt", lambda: run_long(r, messages, args.long_max_tokens, timeout))
            if x:
                r.long = x
                say(f"   {name:9s} long prompt: HTTP {x['status']} {x.get('error_code') or ''} in "
                    f"{x.get('time_s', 0):.1f}s ({x.get('prompt_tokens')} tok); /health not ok "
                    f"{len(x['health_not_ok'])}× of {x['health_polls']}")

    profile: list[dict] = []
    if args.profile:
        folders = sorted((runs[names[-1]].home / "models" / "gguf").glob("*/config.json"))
        if folders:
            profile = run_profiles(folders[0].parent, args.profile_steps, timeout=300)
        else:
            notes.append("profile skipped: no converted model folder found")

    for r in runs.values():
        r.way.close()
        if not r.alive:
            notes.append(f"{r.arm.name}: the engine exited ({r.server.proc.returncode}) during the run")
        for e in r.errors:
            notes.append(f"{r.arm.name}: {e[:300]}")
        cached = max(((x["cached_prompt_tokens"] or 0) for x in r.prefill), default=0)
        if cached:
            notes.append(f"{r.arm.name}: {cached} prompt tokens came from a cache: its prefill is optimistic")
        tokens = {x["completion_tokens"] for x in r.decode}
        if tokens and min(tokens) < args.max_tokens:
            notes.append(f"{r.arm.name}: decode stopped early ({sorted(tokens)} of {args.max_tokens} tokens): EOS")
    summary = summarize(runs)
    result = {"arms": {}, "summary": summary, "comparison": compare(runs, summary), "goals": goals(summary, runs),
              "profile": profile, "notes": notes}
    result["decode_limit"] = decode_limit(profile, summary)
    for name, r in runs.items():
        result["arms"][name] = {"label": r.arm.label, "fast_blas": r.arm.fast_blas, "cpu_float32": r.arm.cpu_float32,
                                "env": dict(r.arm.env) | ({BLAS_ENV: "reference"} if not r.arm.fast_blas else {}),
                                "layout": r.arm.layout,
                                "engine": r.engine, "warmup": r.warmup, "prefill": r.prefill, "decode": r.decode,
                                "long": r.long, "errors": r.errors, "log": str(r.server.log_path)}
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, help="the GGUF to serve (default: the default model's, "
                                              "core/default_model.py gguf_path())")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"comma-separated subset of {','.join(ARMS)} (default: {','.join(DEFAULT_ARMS)})")
    p.add_argument("--rounds", type=int, help="measured rounds (default 3; --quick 1)")
    p.add_argument("--warmup", type=int, default=1, help="short warm-up requests per arm (default 1)")
    p.add_argument("--prompt-tokens", type=int, help="the prefill prompt's length (default 512; --quick 256)")
    p.add_argument("--max-tokens", type=int, help="decoded tokens per run (default 128; --quick 32)")
    p.add_argument("--long-tokens", type=int, default=2000, help="the long chat prompt's length; 0: none (2000)")
    p.add_argument("--long-arms", help="arms that get the long prompt (default: every arm; --quick: after)")
    p.add_argument("--long-max-tokens", type=int, default=16, help="tokens answered to the long prompt (16)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                   help="micro-profile a float32 decode step in a child process (default: on; --quick: off)")
    p.add_argument("--profile-steps", type=int, default=16, help="decode steps timed by the profile (16)")
    p.add_argument("--quick", action="store_true", help="1 round, shorter prompts, the long prompt on 'after' only")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for an engine to be ready")
    p.add_argument("--read-timeout", type=float, default=900.0, help="seconds a request may take")
    p.add_argument("--keep-logs", action="store_true", help="keep the engines' logs next to --out")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    q = args.quick
    args.rounds = args.rounds if args.rounds is not None else (1 if q else 3)
    args.prompt_tokens = args.prompt_tokens if args.prompt_tokens is not None else (256 if q else 512)
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (32 if q else 128)
    args.profile = args.profile if args.profile is not None else not q
    if args.rounds < 1 or args.warmup < 0 or args.max_tokens < 2 or args.prompt_tokens < 16:
        p.error("need --rounds >= 1, --warmup >= 0, --max-tokens >= 2, --prompt-tokens >= 16")
    args.arms_list = chosen(p, "--arms", args.arms, list(ARMS))
    long_arms = args.long_arms if args.long_arms is not None else ("after" if q else ",".join(args.arms_list))
    args.long_arms_list = [a.strip() for a in long_arms.split(",") if a.strip()]
    bad = [a for a in args.long_arms_list if a not in ARMS]
    if bad:
        p.error(f"--long-arms: unknown {bad}")
    if args.gguf is None:
        from mlxd import default_model

        args.gguf = default_model.gguf_path()
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--profile-child"]:  # run_profiles' child: one JSON line on stdout
        folder, dtype, steps = argv[1], argv[2], int(argv[3])
        print(json.dumps(profile_child(folder, dtype, steps)))
        return 0
    if argv[:1] == [ENGINE_LAYOUT] and argv[2:3] == ["--"]:  # an arm's engine (engine_launcher)
        return engine_with_layout(argv[1], argv[3:])
    args = parse_args(argv)
    interrupt_on_sigterm()
    if not args.gguf.is_file():
        say(f"error: the model's GGUF is missing: {args.gguf}\n"
            "       run ./scripts/setup.sh (it fetches the default model), or give --gguf PATH")
        return 1
    settings = {"model": args.gguf.name, "gguf": str(args.gguf), "arms": args.arms_list, "rounds": args.rounds,
                "warmup": args.warmup, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                "long_tokens": args.long_tokens, "long_arms": args.long_arms_list if args.long_tokens else [],
                "long_max_tokens": args.long_max_tokens, "profile": args.profile, "quick": args.quick,
                "stuck_grace_s": 30.0, "prompt_cache": False, "sampling": {"temperature": 0.0},
                "goals": {"prefill_tok_s": GOAL_PREFILL_TOK_S, "decode_tok_s": GOAL_DECODE_TOK_S},
                "arm_settings": {n: asdict(ARMS[n]) for n in args.arms_list},
                "metrics": {"prefill_tok_s": "usage.prompt_tokens / (request sent -> first content chunk), "
                                             "max_tokens 1, streamed /v1/completions",
                            "decode_tok_s": "(window - 1) / (t_last - t_first) over content-carrying chunks",
                            "decode_cpu_s_per_token": "the engine process's user+system CPU during the decode "
                                                      "request / completion tokens (includes its short prefill)"}}
    started = time.monotonic()
    info = machine_info()
    info["fast_path_probe"] = fast_path_probe()
    if not sys.platform.startswith("linux") or "cpu" not in str(info.get("mlx_device", "")).lower():
        say("note: this benchmark is for MLX's CPU backend on Linux; elsewhere the arms differ in name only")
    say(f"== {args.gguf.name}: arms {', '.join(args.arms_list)}; this machine's fast path: "
        f"{info['fast_path_probe'].get('why')}")
    workdir = Path(tempfile.mkdtemp(prefix="mlxd-bench-cpu-"))
    results: dict[str, Any] | None = None
    try:
        results = bench(args, workdir)
    except KeyboardInterrupt:
        say("interrupted: stopping the engines")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        stop_all_children()
        if args.keep_logs:
            logs = args.out.parent / f"{args.out.stem}-logs"
            shutil.rmtree(logs, ignore_errors=True)
            logs.mkdir(parents=True, exist_ok=True)
            for log in workdir.glob("*/engine.log"):
                shutil.copy(log, logs / f"{log.parent.name}.log")
            say(f"engine logs: {logs}")
        shutil.rmtree(workdir, ignore_errors=True)
    if args.keep_logs and results is not None:
        for name, a in results["arms"].items():
            a["log"] = str(args.out.parent / f"{args.out.stem}-logs" / f"{name}.log")
    settings["wall_s"] = round(time.monotonic() - started, 1)
    info["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    doc = {"machine": info, "settings": settings, "results": results}
    write_json(args.out, doc)
    print(markdown(doc))
    say(f"\nresults: {args.out} (total {settings['wall_s']:.0f}s)")
    broken = [n for n, a in results["arms"].items() if not a["prefill"] or not a["decode"]
              or (a["long"] is not None and not a["long"].get("answered_by_engine"))
              or (n in settings["long_arms"] and a["long"] is None)]
    if broken:
        say(f"failed: {', '.join(broken)} (no figures, or the long prompt not answered by the engine)")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
