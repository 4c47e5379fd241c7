#!/usr/bin/env python3
"""Lazy weight loading (issue 25, item 3): what mlx-lm's `lazy=True` changes
in load time, the first request's time to first token and memory, against
the default the engine uses today (`engine/model/model_load.py` `load_resident()`:
`mlx_lm.utils.load(folder)`, lazy=False, every parameter evaluated at load).

Arms, each in a fresh subprocess (its own allocator, nothing imported yet):

  eager       load(folder) -- lazy=False, today's engine
  lazy        load(folder, lazy=True); the weights are read by the first
              request's forward pass
  lazy_eval   load(folder, lazy=True), then mx.eval(model.parameters())
  lazy_chunks load(folder, lazy=True), then the parameters evaluated a
              chunk (~256 MiB of them) at a time: every weight resident
              before the first request, but a conversion (--float32) never
              holds the stored and the converted copy of every weight at once

Each child then serves a first request (a short chat prompt, greedy,
--max-tokens) and a second one (its TTFT is the forward pass alone: the
first's minus the second's is what reading the weights cost the first).

Per run: time to loaded (load() called -> returned, with the explicit eval
of lazy_eval and lazy_chunks), the first request's TTFT, load + first token (what a user
whose request triggers the load waits), the second request's TTFT; the
process's resident set (VmRSS now, VmHWM peak, from /proc/self/status) and
MLX's mx.get_active_memory()/mx.get_peak_memory() after the load and after
the first request (MLX's peak is reset between the two, so the request's is
its own); the process's CPU seconds (all threads) of the load and of each
request, which other programs on the cores bend far less than wall time. The parent records how much of the weight files is in the page
cache (mincore) before each run, and the load average.

Page cache (--cache): `warm` reads the weight files once beforehand, so every
run reads them from memory; `cold` evicts them before each run with
posix_fadvise(DONTNEED) -- only this model's own files, no root needed (on a
VM the host may still cache them: "cold" is the guest's page cache only).
After --warmup unmeasured runs (MLX's CUDA backend compiles its kernels
on a machine's first run), the arms alternate, rotated each round
(--rounds, 3); the table gives medians and min-max.

  .venv/bin/python bench/weights_load.py                     # demo model c (~1.4 GB float32), warm + cold
  .venv/bin/python bench/weights_load.py --quick             # demo model a, 1 round, warm: a smoke test
  .venv/bin/python bench/weights_load.py --float32 --model-dir FOLDER    # the engine's CPU path: dequantised, float32
  PYTHONPATH=/tmp/site:/tmp/site2 python3 bench/weights_load.py --model-dir /tmp/models/demo-8b --cache warm \
      --json-out $OUT/weights_load_8b_warm.json
      # an NVIDIA GPU (MLX's CUDA backend, after `BUILD_ONLY=1 bash bench/gpu_run.sh engine`): one cache
      # mode per call keeps the 13 loads of 15 GB inside a 10-minute command (~30 s each on an H100)

Progress goes to stderr, the Markdown table to stdout, every run's figures
to --json-out (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (tests)
from benchkit import RESULTS, chosen, demo_model, machine_info, say, variants, write_json  # noqa: E402

ARMS = ("eager", "lazy", "lazy_eval", "lazy_chunks")
LABEL = {"eager": "lazy=False (today)", "lazy": "lazy=True, read by the 1st request",
         "lazy_eval": "lazy=True + mx.eval(params)", "lazy_chunks": "lazy=True + eval in chunks"}
CACHE_MODES = ("warm", "cold")
DEFAULT_OUT = RESULTS / "weights_load.json"
RESULT_MARK = "WEIGHTS_LOAD_RESULT "
PROMPT = "Explain in one sentence why a model's weights are read from disk before it can answer."
MIB = 1024 * 1024


# --- pure parts ---------------------------------------------------------------------------------

def schedule(arms: list[str], rounds: int, caches: list[str]) -> list[tuple[int, str, str]]:
    """(round, cache, arm) in run order: per cache mode, `rounds` rounds of
    every arm, the order rotated by one each round (no arm always first)."""
    out = []
    for cache in caches:
        for r in range(rounds):
            k = r % len(arms)
            out.extend((r, cache, arm) for arm in arms[k:] + arms[:k])
    return out


def parse_proc_status(text: str) -> dict[str, int]:
    """/proc/<pid>/status's VmRSS and VmHWM (and VmSwap), in bytes."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "VmSwap"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                scale = 1024 if len(parts) < 2 or parts[1].lower() == "kb" else 1
                out[key] = int(parts[0]) * scale
    return out


def resident_fraction(vec: Iterable[int]) -> float:
    """The share of pages mincore() reports resident (bit 0 of each byte)."""
    vec = list(vec)
    return sum(b & 1 for b in vec) / len(vec) if vec else math.nan


def parse_child_output(stdout: str) -> dict[str, Any] | None:
    """The child's result: the JSON after RESULT_MARK on its last such line."""
    found = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARK):
            found = json.loads(line[len(RESULT_MARK):])
    return found


def median(xs: Iterable[float | None]) -> float:
    v = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not v:
        return math.nan
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


# The figures summarised per (cache, arm): name -> path into a run's result.
FIGURES = {
    "load_s": ("load_s",),
    "ttft_s": ("first", "ttft_s"),
    "load_to_first_token_s": ("load_to_first_token_s",),
    "load_cpu_s": ("load_cpu_s",),
    "first_cpu_s": ("first_cpu_s",),
    "second_cpu_s": ("second_cpu_s",),
    "load_and_first_cpu_s": ("load_and_first_cpu_s",),
    "second_ttft_s": ("second", "ttft_s"),
    "rss_loaded": ("after_load", "rss"),
    "hwm_loaded": ("after_load", "hwm"),
    "rss_first": ("after_first", "rss"),
    "hwm_first": ("after_first", "hwm"),
    "mlx_active_loaded": ("after_load", "mlx_active"),
    "mlx_peak_loaded": ("after_load", "mlx_peak"),
    "mlx_active_first": ("after_first", "mlx_active"),
    "mlx_peak_first": ("after_first", "mlx_peak"),
    "cached_before": ("page_cache_before",),
}


def _get(run: dict, path: tuple[str, ...]) -> float | None:
    cur: Any = run
    for key in path:
        if not isinstance(cur, dict) or cur.get(key) is None:
            return None
        cur = cur[key]
    return float(cur)


def summarize(runs: list[dict]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """{cache: {arm: {figure: {median, min, max, n}}}} over the runs without an
    error, in the order the caches and arms first appear."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for run in runs:
        out.setdefault(run["cache"], {}).setdefault(run["arm"], {})
    for cache, arms in out.items():
        for arm in arms:
            ok = [r for r in runs if r["cache"] == cache and r["arm"] == arm and not r.get("error")]
            stats = {}
            for name, path in FIGURES.items():
                vals = [v for v in (_get(r, path) for r in ok) if v is not None and not math.isnan(v)]
                stats[name] = ({"median": median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
                               if vals else {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0})
            stats["errors"] = {"n": sum(1 for r in runs if r["cache"] == cache and r["arm"] == arm and r.get("error"))}
            arms[arm] = stats
    return out


def _secs(st: dict[str, float]) -> str:
    if st["n"] == 0:
        return "—"
    m = f"{st['median']:.2f}"
    return m if st["n"] == 1 or st["min"] == st["max"] else f"{m} ({st['min']:.2f}–{st['max']:.2f})"


def _mib(st: dict[str, float]) -> str:
    return "—" if st["n"] == 0 else f"{st['median'] / MIB:,.0f}"


def _pct(st: dict[str, float]) -> str:
    return "—" if st["n"] == 0 else f"{100 * st['median']:.0f} %"


def table(summary: dict, model_label: str, device: str) -> str:
    """The Markdown tables: times (median, min–max) and memory (medians, MiB)."""
    lines = []
    for cache, arms in summary.items():
        lines += [f"**{model_label}, {device}, page cache {cache}** (medians of "
                  f"{max((a['load_s']['n'] for a in arms.values()), default=0)} runs; min–max in brackets)", "",
                  "| arm | load s | 1st request TTFT s | load → 1st token s | 2nd request TTFT s | "
                  "CPU s: load | 1st request | 2nd request | load + 1st request | weights cached before |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm, st in arms.items():
            err = f" ({st['errors']['n']} failed)" if st["errors"]["n"] else ""
            lines.append(f"| {LABEL.get(arm, arm)}{err} | {_secs(st['load_s'])} | {_secs(st['ttft_s'])} | "
                         f"{_secs(st['load_to_first_token_s'])} | {_secs(st['second_ttft_s'])} | "
                         f"{_secs(st['load_cpu_s'])} | {_secs(st['first_cpu_s'])} | {_secs(st['second_cpu_s'])} | "
                         f"{_secs(st['load_and_first_cpu_s'])} | {_pct(st['cached_before'])} |")
        lines += ["", "| arm (MiB) | RSS loaded | RSS peak loaded | RSS after 1st | RSS peak after 1st | "
                  "MLX active loaded | MLX peak load | MLX active after 1st | MLX peak 1st request |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm, st in arms.items():
            lines.append(f"| {LABEL.get(arm, arm)} | {_mib(st['rss_loaded'])} | {_mib(st['hwm_loaded'])} | "
                         f"{_mib(st['rss_first'])} | {_mib(st['hwm_first'])} | {_mib(st['mlx_active_loaded'])} | "
                         f"{_mib(st['mlx_peak_loaded'])} | {_mib(st['mlx_active_first'])} | "
                         f"{_mib(st['mlx_peak_first'])} |")
        lines.append("")
    return "\n".join(lines)


def compare(summary: dict, base: str = "eager") -> dict[str, dict[str, dict[str, float]]]:
    """Per cache and arm, the median differences to `base` (seconds, bytes):
    load, load -> first token, peak RSS after the first request, MLX peak."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for cache, arms in summary.items():
        if base not in arms:
            continue
        b = arms[base]
        for arm, st in arms.items():
            if arm == base:
                continue
            out.setdefault(cache, {})[arm] = {
                k: st[k]["median"] - b[k]["median"]
                for k in ("load_s", "load_to_first_token_s", "load_and_first_cpu_s", "hwm_first", "mlx_peak_loaded",
                          "mlx_active_first")}
    return out


# --- the page cache (parent) --------------------------------------------------------------------

def weight_files(folder: Path) -> list[Path]:
    """The files mlx-lm reads the weights from (`model*.safetensors`)."""
    return sorted(folder.glob("model*.safetensors"))


def page_cache_fraction(files: list[Path]) -> float | None:
    """How much of `files` (by pages) is in the page cache, via mmap + mincore;
    None where that cannot be asked (no libc mincore)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: no page is touched
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec)
                total += pages
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return resident / total if total else None


def evict(files: list[Path]) -> bool:
    """Drops these files' clean pages from the page cache (posix_fadvise
    DONTNEED: this file only, no root); False where the OS has no such call."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def prime(files: list[Path]) -> None:
    """Reads the files once, so they are in the page cache."""
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 * MIB):
                pass


def read_speed(files: list[Path], cache: str) -> dict[str, float]:
    """Reading the weight files end to end (64 MiB reads), the floor of any load: from the page cache
    (`warm`) or, after evicting them, from the disk (`cold`; on a VM the host may still cache them)."""
    if cache == "warm":
        prime(files)
    else:
        evict(files)
    total, began = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(64 * MIB):
                total += len(chunk)
    seconds = time.perf_counter() - began
    return {"bytes": total, "s": seconds, "gb_per_s": total / seconds / 1e9}


def speed_lines(weight_bytes: int, runs: list[dict], reads: dict[str, dict[str, float]]) -> str:
    """Load speed per GB against the files' read speed, per cache mode (pure)."""
    lines = []
    for cache, read in reads.items():
        loads = [r["load_s"] for r in runs if r.get("cache") == cache and r.get("arm") == "eager" and r.get("load_s")]
        if not loads:
            continue
        load_s = median(loads)
        lines.append(f"- {cache}: eager load {weight_bytes / 1e9 / load_s:.2f} GB/s ({load_s:.2f} s a load, "
                     f"{load_s / (weight_bytes / 1e9):.2f} s per GB) against reading the files "
                     f"{read['gb_per_s']:.2f} GB/s in one sequential stream: the load at "
                     f"{weight_bytes / 1e9 / load_s / read['gb_per_s']:.2f}x the read's speed")
    return "\n".join(lines)


# --- one arm (the child) ------------------------------------------------------------------------

def memory_now() -> dict[str, float | None]:
    """The process's resident set (now, peak) and MLX's active/peak bytes."""
    import mlx.core as mx

    out: dict[str, float | None] = {"rss": None, "hwm": None}
    try:
        st = parse_proc_status(Path("/proc/self/status").read_text())
        out["rss"], out["hwm"] = st.get("VmRSS"), st.get("VmHWM")
    except OSError:  # macOS: no /proc
        import resource

        import psutil

        out["rss"] = psutil.Process().memory_info().rss
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["hwm"] = peak if sys.platform == "darwin" else peak * 1024
    out["mlx_active"] = mx.get_active_memory()
    out["mlx_peak"] = mx.get_peak_memory()
    out["mlx_cache"] = mx.get_cache_memory()
    return out


def one_request(model, tokenizer, max_tokens: int, now) -> dict[str, Any]:
    """A short chat prompt, greedy: TTFT (call -> first token) and the total."""
    from mlx_lm.generate import stream_generate

    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    t0 = now()
    first = None
    tokens: list[int] = []
    for resp in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        tokens.append(int(resp.token))
        if first is None:
            first = now()
    end = now()
    # the token ids: every arm must answer the same (greedy, the same weights)
    return {"ttft_s": (first - t0) if first is not None else None, "total_s": end - t0, "tokens": len(tokens),
            "prompt_tokens": len(prompt), "token_ids": tokens}


def load_arm(arm: str, folder: Path, float32: bool):
    """The arm's load, as `engine/model/model_load.py` `load_resident()` does it (with
    `float32`: its CPU fast path, dequantised and cast to float32) but for
    `lazy`: nothing evaluated (the lazy arms: mlx-lm's lazy=True)."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tokenizer = load(str(folder), lazy=arm != "eager")
    if float32:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        if arm in ("eager", "lazy_eval"):
            mx.eval(model.parameters())
    elif arm == "lazy_eval":
        mx.eval(model.parameters())
    if arm == "lazy_chunks":
        from mlxd.engine.model.model_load import evaluate_in_chunks  # what the engine's load does

        evaluate_in_chunks(model.parameters())
    return model, tokenizer


def run_child(arm: str, folder: Path, max_tokens: int, float32: bool = False) -> dict[str, Any]:
    now, cpu = time.perf_counter, time.process_time
    t_start = now()
    try:  # the engine's fast CPU path (engine/cpu/fast_blas.py), before MLX is imported
        from mlxd.engine.cpu.fast_blas import activate

        blas = activate().name
    except Exception as e:  # noqa: BLE001 -- not the subject here; say which
        blas = f"unavailable ({type(e).__name__})"
    import mlx.core as mx
    import mlx_lm.generate  # noqa: F401 -- imported before the clock starts, as the engine has it
    import mlx_lm.utils  # noqa: F401

    t_imported = now()
    before = memory_now()
    t0, c0 = now(), cpu()
    model, tokenizer = load_arm(arm, folder, float32)
    t_loaded, c_loaded = now(), cpu()
    after_load = memory_now()
    mx.reset_peak_memory()
    first = one_request(model, tokenizer, max_tokens, now)
    c_first = cpu()
    after_first = memory_now()
    second = one_request(model, tokenizer, max_tokens, now)
    c_second = cpu()
    ttft = first["ttft_s"]
    return {
        "arm": arm, "device": str(mx.default_device()), "blas": blas, "float32": float32,
        "import_s": t_imported - t_start, "load_s": t_loaded - t0,
        "load_to_first_token_s": (t_loaded - t0) + ttft if ttft is not None else None,
        # the process's CPU seconds (every thread): less bent by other programs on the cores than the wall clock
        "load_cpu_s": c_loaded - c0, "first_cpu_s": c_first - c_loaded, "second_cpu_s": c_second - c_first,
        "load_and_first_cpu_s": c_first - c0,
        "first": first, "second": second,
        "before_load": before, "after_load": after_load, "after_first": after_first,
        "pid": os.getpid(),
    }


# --- the parent -----------------------------------------------------------------------------------

def run_arm(arm: str, folder: Path, max_tokens: int, timeout: float, float32: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", arm, "--model-dir", str(folder),
           "--max-tokens", str(max_tokens)] + (["--float32"] if float32 else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    result = parse_child_output(proc.stdout)
    if proc.returncode != 0 or result is None:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    result["wall_s"] = time.perf_counter() - t0
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="a model folder (default: the demo model --variant, built once)")
    p.add_argument("--variant", default=None, choices=variants(),
                   help="demo model to build (default c; a with --quick)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {','.join(ARMS)}")
    p.add_argument("--cache", default=None, help="page cache: warm, cold or warm,cold (default; warm with --quick)")
    p.add_argument("--rounds", type=int, default=None, help="runs per arm and cache mode (3; 1 with --quick)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (16; 4 with --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="unmeasured runs of the first arm first (1; 0 with --quick): MLX's CUDA backend "
                        "compiles its kernels on the first run on a machine and caches them on disk")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one child may take")
    p.add_argument("--json-out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--float32", action="store_true",
                   help="load as the engine's CPU fast path does: dequantised and cast to float32")
    p.add_argument("--quick", action="store_true", help="demo model a, 1 round, warm, 4 tokens: a smoke test")
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    args.arms_list = chosen(p, "--arms", args.arms, ARMS)
    args.cache_list = chosen(p, "--cache", args.cache or ("warm" if args.quick else "warm,cold"), CACHE_MODES)
    args.variant = args.variant or ("a" if args.quick else "c")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.warmup = (0 if args.quick else 1) if args.warmup is None else args.warmup
    args.max_tokens = args.max_tokens or (4 if args.quick else 16)
    if args.rounds < 1 or args.max_tokens < 1:
        p.error("--rounds and --max-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(RESULT_MARK + json.dumps(run_child(args.child, args.model_dir, args.max_tokens, args.float32)),
              flush=True)
        return 0
    if args.model_dir:
        folder, label = args.model_dir.resolve(), args.model_dir.name
    else:
        label, folder = demo_model(args.variant)
    files = weight_files(folder)
    if not files:
        say(f"no model*.safetensors in {folder}")
        return 2
    weight_bytes = sum(f.stat().st_size for f in files)
    label = f"{label}, {weight_bytes / MIB:,.0f} MiB of safetensors" + (", loaded as float32" if args.float32 else "")
    caches = list(args.cache_list)
    if "cold" in caches and not hasattr(os, "posix_fadvise"):
        say("cold: no posix_fadvise on this OS (the page cache cannot be dropped per file): warm only")
        caches = [c for c in caches if c != "cold"] or ["warm"]
    warmups = []
    for w in range(args.warmup):
        say(f"warm-up {w + 1}/{args.warmup}: {args.arms_list[0]} (not measured)")
        warmups.append(run_arm(args.arms_list[0], folder, args.max_tokens, args.timeout, args.float32))
    runs: list[dict[str, Any]] = []
    plan = schedule(args.arms_list, args.rounds, caches)
    for i, (rnd, cache, arm) in enumerate(plan, 1):
        if cache == "warm":
            if (page_cache_fraction(files) or 0.0) < 0.999:
                prime(files)
        else:
            evict(files)
        cached = page_cache_fraction(files)
        load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        say(f"[{i}/{len(plan)}] {cache} round {rnd + 1}: {arm} (weights cached: "
            f"{'?' if cached is None else f'{100 * cached:.0f} %'}, load avg {load_before})")
        res = run_arm(arm, folder, args.max_tokens, args.timeout, args.float32)
        res.update({"arm": arm, "cache": cache, "round": rnd, "page_cache_before": cached,
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None})
        if res.get("error"):
            say(f"   failed: {res['error']}")
        else:
            say(f"   load {res['load_s']:.2f} s ({res['load_cpu_s']:.2f} CPU s), "
                f"1st TTFT {res['first']['ttft_s']:.2f} s, "
                f"load->1st token {res['load_to_first_token_s']:.2f} s, 2nd TTFT {res['second']['ttft_s']:.2f} s, "
                f"peak RSS {res['after_first']['hwm'] / MIB:,.0f} MiB, "
                f"MLX active {res['after_first']['mlx_active'] / MIB:,.0f} MiB")
        runs.append(res)
    reads = {cache: read_speed(files, cache) for cache in caches}
    for cache, read in reads.items():
        say(f"reading the files, {cache}: {read['gb_per_s']:.2f} GB/s ({read['s']:.2f} s)")
    summary = summarize(runs)
    device = next((r["device"] for r in runs if r.get("device")), "?")
    md = table(summary, label, device)
    speeds = speed_lines(weight_bytes, runs, reads)
    if speeds:
        md += "\n\nLoad speed against the files' read speed:\n" + speeds
    print(md)
    write_json(args.json_out, {
        "benchmark": "weights_load", "machine": machine_info(), "model": {"folder": str(folder), "label": label,
                                                                          "weight_bytes": weight_bytes},
        "settings": {"float32": args.float32, "arms": args.arms_list, "caches": caches, "rounds": args.rounds,
                     "max_tokens": args.max_tokens, "warmup": args.warmup, "prompt": PROMPT},
        "warmup_runs": warmups, "runs": runs, "reads": reads, "summary": summary, "vs_eager": compare(summary), "table": md})
    say(f"results: {args.json_out}")
    return 1 if any(r.get("error") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
