#!/usr/bin/env python3
"""Concurrent clients: aggregate throughput, TTFT and peak memory with 1, 2,
4, 8 streaming clients, side by side in one run for

  single   mlxd's engine as configured by default: one request at a time,
           the others queued
  batched  mlxd's engine with `[engine] max_concurrency = B` (--batch-size, 8)
  mlx_lm   `python -m mlx_lm server --decode-concurrency B --prompt-concurrency B`

For each client count, each round starts that many threads together (a
barrier); each sends one streamed `POST /v1/chat/completions` (greedy,
--max-tokens) with its own prompt of about --prompt-tokens tokens. Every
prompt of the run is distinct from its first word on (no two share a
prefix, across clients and rounds), so no prompt cache helps. The arms run
one after another (one server at a time: their memory is measured alone),
the client counts in ascending order, --rounds measured rounds after
--warmup unmeasured ones per client count.

Per arm and client count:
  aggregate tok/s  completion tokens of the round / (last stream end - first
                   request sent); the median over the rounds
  TTFT p50/p95     request sent -> first content chunk, over every request of
                   every measured round (linear interpolation between ranks)
  peak memory      the server process's: on an NVIDIA GPU nvidia-smi's
                   per-process used memory (or the device's used memory over
                   its level before the server started), polled; otherwise
                   the resident set (RSS), polled; for mlxd also /health's
                   mlx_peak_bytes (MLX's own peak since the model loaded)
                   against the engine's budget_bytes
Single mode, 2+ clients: the gap between queued requests = each queued
request's first token - the end of the request served before it - the
median TTFT of a lone request (the 1-client rounds): what the queue adds
beyond the request's own prefill.

  .venv/bin/python bench/concurrency.py                    # demo model a, all arms
  .venv/bin/python bench/concurrency.py --arms single,mlx_lm --clients 1,2 --max-tokens 16 --prompt-tokens 200
  .venv/bin/python bench/concurrency.py --model PATH --startup-timeout 300

Progress goes to stderr, the Markdown table to stdout, every request's
timings to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import psutil
import requests

try:
    from mlxd.engine.core.device_memory import parse_compute_apps
except ImportError:  # an mlxd from before engine/ had folders (gpu_run.sh's BUILDS=old)
    from mlxd.engine.device_memory import parse_compute_apps  # type: ignore[no-redef]
from mlxd.toml_text import dumps, table_lines

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (tests)
from benchkit import (DEFAULT_CACHE, RESULTS, BenchError, HttpWay, Server, Trace, child_env,  # noqa: E402
                      demo_model, free_port, interrupt_on_sigterm, machine_info, now, one_model_config, say, spawn,
                      start_engine, stop_all_children, stop_child, variants, write_json)
from mlxd.reports import EngineHealth  # noqa: E402

ARMS = ("single", "batched", "mlx_lm")
LABEL = {"single": "mlxd single", "batched": "mlxd batched", "mlx_lm": "mlx_lm.server"}
DEFAULT_OUT = RESULTS / "concurrency.json"
CHAT = "/v1/chat/completions"
MIB = 1024 * 1024

# The goals.
GOAL_BATCHED_VS_MLX_LM = 1.10  # aggregate tok/s at 4 and 8 clients
GOAL_BATCHED_VS_SINGLE_1 = 0.97  # one client
GOAL_GAP_MS = 20.0  # single mode: the gap between queued requests, beyond a lone TTFT (median)
GOAL_CLIENTS = (4, 8)


# --- pure parts: statistics ----------------------------------------------------------------

def pctl(values: Iterable[float | None], q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation between closest ranks
    (numpy's default); None values are left out; None when nothing is left."""
    v = sorted(x for x in values if x is not None and not math.isnan(x))
    if not v:
        return None
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def median(values: Iterable[float | None]) -> float | None:
    return pctl(values, 0.5)


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


@dataclass
class Req:
    """One streamed request's timings (perf_counter seconds) and token counts."""
    client: int
    t0: float  # just before the request was sent
    t_first: float | None  # the first content-carrying chunk
    t_end: float  # the last event of the stream
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None = None
    t_last: float | None = None  # the last content-carrying chunk

    @property
    def end_after_last(self) -> float | None:
        """From the last token to the stream's end: what the server does after the answer (a store, a write)."""
        return None if self.t_last is None else self.t_end - self.t_last

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t0


def aggregate_tok_s(reqs: list[Req]) -> float | None:
    """All completion tokens / (last stream end - first request sent)."""
    if not reqs:
        return None
    wall = max(r.t_end for r in reqs) - min(r.t0 for r in reqs)
    return sum(r.completion_tokens for r in reqs) / wall if wall > 0 else None


def queue_gaps(reqs: list[Req], lone_ttft: float) -> list[float]:
    """Requests served one at a time: in the order of their first tokens, each
    one after the first: its first token - the end of the one before it -
    `lone_ttft` (what a request alone waits for its first token). Seconds."""
    served = sorted((r for r in reqs if r.t_first is not None), key=lambda r: r.t_first)
    return [cur.t_first - prev.t_end - lone_ttft for prev, cur in zip(served, served[1:])]


# --- pure parts: the prompts -----------------------------------------------------------------

# Distinct first letters: consecutive prompt numbers start with different letters.
SYLLABLES = ("ba", "ce", "di", "fo", "gu", "ha", "je", "ki", "lo", "mu", "na", "pe", "qui", "ro", "su", "ti",
             "vo", "wa", "xe", "yu", "zo")
WORDS = ("river", "stone", "paper", "engine", "garden", "window", "silver", "market", "winter", "signal", "copper",
         "harbor", "forest", "ladder", "candle", "bridge", "planet", "circle", "mirror", "anchor", "valley", "pencil",
         "basket", "thunder", "meadow", "rocket", "castle", "button", "island", "jacket", "kettle", "lantern",
         "needle", "orange", "pepper", "quartz", "saddle", "tunnel", "velvet", "walnut", "yellow", "zipper", "amber",
         "breeze", "cactus", "dragon", "ember", "falcon", "glacier", "hammer", "ivory", "jungle", "kernel", "lemon",
         "marble", "nectar", "oyster", "pillow", "quiver", "ribbon", "spider", "timber", "violet", "whistle",
         "cobalt", "dune", "echo", "fiber", "grain", "honey", "ink", "jade", "knot", "lunar", "mint", "north",
         "opal", "prism", "quill", "rust", "solar", "tide", "umber", "vapor", "wool", "yarn", "zenith", "the", "a",
         "of", "and", "to", "in", "is", "with", "for", "on", "was", "by", "under", "over", "after", "before")


def lead_word(k: int) -> str:
    """Prompt k's first word: k's digits in base len(SYLLABLES) as syllables,
    the lowest first, so prompts k and k+1 differ from their first letter."""
    base = len(SYLLABLES)
    parts = [SYLLABLES[k % base]]
    k //= base
    while k:
        parts.append(SYLLABLES[k % base])
        k //= base
    return "".join(parts).capitalize()


def prompt_words(k: int, n: int) -> list[str]:
    """Prompt k's first n words: its lead word, then words drawn with k as the seed."""
    rng = random.Random(f"mlxd-concurrency-{k}")
    words = [lead_word(k)]
    while len(words) < n:
        w = rng.choice(WORDS)
        words.append(w + ("." if rng.random() < 0.1 else ""))
    return words[:n]


def make_prompt(k: int, n_tokens: int, count: Callable[[str], int]) -> str:
    """Prompt number k: about `n_tokens` tokens by `count` (the most words
    whose text counts at most n_tokens, at least one word)."""
    hi = max(8, n_tokens)
    while count(" ".join(prompt_words(k, hi))) < n_tokens and hi < 64 * max(n_tokens, 1):
        hi *= 2
    words = prompt_words(k, hi)
    lo, hi = 1, len(words)  # the largest n in [lo, hi] with count(n words) <= n_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


@dataclass(frozen=True)
class Step:
    """One round of the plan: `clients` requests at once, prompt numbers `ks`."""
    clients: int
    round: int  # 0-based within its kind (warmup or measured)
    warmup: bool
    ks: tuple[int, ...]


def plan(client_counts: list[int], rounds: int, warmup: int) -> list[Step]:
    """Every round of an arm, in order, each request with its own prompt number
    (the same plan, hence the same prompts, for every arm)."""
    steps, k = [], 1  # prompt 0: the connection warm-up right after the server starts
    for c in client_counts:
        for warm, n in ((True, warmup), (False, rounds)):
            for r in range(n):
                steps.append(Step(c, r, warm, tuple(range(k, k + c))))
                k += c
    return steps


# --- pure parts: summary, goals, table --------------------------------------------------------

def summarize_block(rounds: list[list[Req]]) -> dict[str, Any]:
    """One arm at one client count: its measured rounds."""
    aggs = [aggregate_tok_s(rs) for rs in rounds]
    ttfts = [r.ttft for rs in rounds for r in rs]
    toks = [r.completion_tokens for rs in rounds for r in rs]
    prompts = [r.prompt_tokens for rs in rounds for r in rs]
    cached = [r.cached_tokens or 0 for rs in rounds for r in rs]
    ends = [r.end_after_last for rs in rounds for r in rs]
    return {"rounds": len(rounds), "agg_tok_s_median": median(aggs), "agg_tok_s_rounds": aggs,
            "end_after_last_ms_p50": ms(pctl(ends, 0.5)), "end_after_last_ms_p95": ms(pctl(ends, 0.95)),
            "ttft_ms_p50": ms(pctl(ttfts, 0.5)), "ttft_ms_p95": ms(pctl(ttfts, 0.95)),
            "ttft_ms_max": ms(max((t for t in ttfts if t is not None), default=None)),
            "completion_tokens_min": min(toks, default=None), "completion_tokens_max": max(toks, default=None),
            "prompt_tokens_min": min(prompts, default=None), "prompt_tokens_max": max(prompts, default=None),
            "cached_tokens_max": max(cached, default=None)}


def gap_summary(single_rounds: dict[int, list[list[Req]]]) -> dict[str, Any] | None:
    """The single arm's gaps between queued requests (ms), from its rounds by
    client count; the lone TTFT is the median of the 1-client rounds'."""
    lone = median(r.ttft for rs in single_rounds.get(1, []) for r in rs)
    if lone is None:
        return None
    gaps = [g * 1e3 for c, rounds in single_rounds.items() if c >= 2 for rs in rounds for g in queue_gaps(rs, lone)]
    if not gaps:
        return None
    return {"lone_ttft_ms": lone * 1e3, "n": len(gaps), "p50_ms": pctl(gaps, 0.5), "p95_ms": pctl(gaps, 0.95),
            "max_ms": max(gaps), "min_ms": min(gaps)}


def headline_memory(mem: dict[str, Any] | None) -> tuple[int | None, str | None]:
    """The figure comparable across arms: GPU memory when measured, else RSS."""
    if not mem:
        return None, None
    if mem.get("gpu_peak_bytes") is not None:
        return mem["gpu_peak_bytes"], mem.get("gpu_source")
    if mem.get("rss_peak_bytes") is not None:
        return mem["rss_peak_bytes"], "RSS"
    return None, None


def goals(blocks: dict[str, dict[int, dict[str, Any]]], gaps: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The issue's goals: each {goal, met (True/False/None: not measured), detail}."""
    out = []

    def add(goal: str, met: bool | None, detail: str) -> None:
        out.append({"goal": goal, "met": met, "detail": detail})

    b, m, s = blocks.get("batched", {}), blocks.get("mlx_lm", {}), blocks.get("single", {})
    for c in GOAL_CLIENTS:
        ba, ma = (b.get(c) or {}).get("agg_tok_s_median"), (m.get(c) or {}).get("agg_tok_s_median")
        if ba is None or ma is None:
            add(f"batched aggregate ≥ {GOAL_BATCHED_VS_MLX_LM:.2f}× mlx_lm.server at {c} clients", None,
                "not measured")
        else:
            add(f"batched aggregate ≥ {GOAL_BATCHED_VS_MLX_LM:.2f}× mlx_lm.server at {c} clients",
                ba >= GOAL_BATCHED_VS_MLX_LM * ma, f"{ba:.1f} / {ma:.1f} tok/s = {ba / ma:.3f}×")
        bt, mt = (b.get(c) or {}).get("ttft_ms_p50"), (m.get(c) or {}).get("ttft_ms_p50")
        if bt is None or mt is None:
            add(f"batched TTFT p50 ≤ mlx_lm.server's at {c} clients", None, "not measured")
        else:
            add(f"batched TTFT p50 ≤ mlx_lm.server's at {c} clients", bt <= mt, f"{bt:.1f} vs {mt:.1f} ms")
    ba, sa = (b.get(1) or {}).get("agg_tok_s_median"), (s.get(1) or {}).get("agg_tok_s_median")
    add(f"one client: batched ≥ {GOAL_BATCHED_VS_SINGLE_1:.2f}× single",
        None if ba is None or sa is None else ba >= GOAL_BATCHED_VS_SINGLE_1 * sa,
        "not measured" if ba is None or sa is None else f"{ba:.1f} / {sa:.1f} tok/s = {ba / sa:.3f}×")
    for arm in ("single", "batched"):
        for c, blk in sorted(blocks.get(arm, {}).items()):
            mem = blk.get("memory") or {}
            peak, budget = mem.get("mlx_peak_bytes"), mem.get("budget_bytes")
            if c == max(blocks[arm]) and peak is not None and budget:
                add(f"{LABEL[arm]}: MLX peak ≤ the engine's budget", peak <= budget,
                    f"{peak / MIB:.0f} MiB of {budget / MIB:.0f} MiB (after {c} clients)")
    top = max((c for c in b if c in m), default=None)
    if top is None:
        add("batched peak memory ≤ mlx_lm.server's at the most clients", None, "not measured")
    else:
        (bp, bsrc), (mp, msrc) = headline_memory(b[top].get("memory")), headline_memory(m[top].get("memory"))
        add(f"batched peak memory ≤ mlx_lm.server's at {top} clients",
            None if bp is None or mp is None else bp <= mp,
            "not measured" if bp is None or mp is None else f"{bp / MIB:.0f} vs {mp / MIB:.0f} MiB ({bsrc})")
    add(f"single: gap between queued requests beyond a lone TTFT ≤ {GOAL_GAP_MS:.0f} ms (median)",
        None if gaps is None else gaps["p50_ms"] <= GOAL_GAP_MS,
        "not measured (needs the single arm at 1 and 2+ clients)" if gaps is None else
        f"p50 {gaps['p50_ms']:.1f} ms, p95 {gaps['p95_ms']:.1f}, max {gaps['max_ms']:.1f} ms over {gaps['n']} "
        f"queued requests (lone TTFT {gaps['lone_ttft_ms']:.1f} ms)")
    return out


def fmt_mib(b: int | None) -> str:
    return "—" if b is None else (f"{b / 1024**3:.2f} GiB" if b >= 1024**3 else f"{b / MIB:.0f} MiB")


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def span(lo: Any, hi: Any) -> str:
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def table(blocks: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    lines = ["| arm | clients | agg tok/s (min–max) | × mlx_lm.server | × single | TTFT p50 ms | TTFT p95 ms | "
             "× mlx_lm TTFT p50 | end after last token p50/p95 ms | peak memory | MLX peak / budget | "
             "tokens/request (prompt+gen) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    counts = sorted({c for arm in blocks.values() for c in arm})
    for c in counts:
        for arm in ARMS:
            blk = blocks.get(arm, {}).get(c)
            if blk is None:
                continue
            agg = blk["agg_tok_s_median"]
            rounds = [a for a in blk["agg_tok_s_rounds"] if a is not None]
            rng = f" ({min(rounds):.0f}–{max(rounds):.0f})" if len(rounds) > 1 else ""
            ref = (blocks.get("mlx_lm", {}).get(c) or {})
            one = (blocks.get("single", {}).get(c) or {})
            ratio = "—" if arm == "mlx_lm" or not ref.get("agg_tok_s_median") or agg is None else \
                f"**{agg / ref['agg_tok_s_median']:.3f}**"
            vs_single = "—" if arm == "single" or not one.get("agg_tok_s_median") or agg is None else \
                f"{agg / one['agg_tok_s_median']:.3f}"
            ttft_ratio = "—" if arm == "mlx_lm" or not ref.get("ttft_ms_p50") or blk["ttft_ms_p50"] is None else \
                f"{blk['ttft_ms_p50'] / ref['ttft_ms_p50']:.3f}"
            mem = blk.get("memory") or {}
            peak, src = headline_memory(mem)
            mlx = "—" if mem.get("mlx_peak_bytes") is None else \
                f"{fmt_mib(mem['mlx_peak_bytes'])} / {fmt_mib(mem.get('budget_bytes'))}"
            toks = span(blk["prompt_tokens_min"], blk["prompt_tokens_max"])
            gen = span(blk["completion_tokens_min"], blk["completion_tokens_max"])
            lines.append(f"| {LABEL[arm]} | {c} | {fmt(agg)}{rng} | {ratio} | {vs_single} | {fmt(blk['ttft_ms_p50'])} "
                         f"| {fmt(blk['ttft_ms_p95'])} | {ttft_ratio} "
                         f"| {fmt(blk.get('end_after_last_ms_p50'))}/{fmt(blk.get('end_after_last_ms_p95'))} "
                         f"| {fmt_mib(peak)}{f' ({src})' if src else ''} "
                         f"| {mlx} | {toks}+{gen} |")
    return lines


def markdown(doc: dict[str, Any]) -> str:
    info, st, res = doc["machine"], doc["settings"], doc["results"]
    device = info.get("gpu") or f"{info['cpu_count']} CPUs ({info.get('cpu') or '?'})"
    lines = [f"### Concurrent clients — {info['date']}", "",
             f"{device}; {info['platform']}, mlx {info['mlx']} ({info['mlx_device']}), mlx-lm {info['mlx_lm']}, "
             f"Python {info['python']}; model {st['model']}",
             f"Streamed chat completions, greedy, max_tokens {st['max_tokens']}, prompts of ~{st['prompt_tokens']} "
             f"tokens, every one distinct from its first word; {st['rounds']} measured round(s) after "
             f"{st['warmup']} warmup round(s) per client count; batch size {st['batch_size']} (mlxd "
             f"max_concurrency, mlx_lm.server --decode/--prompt-concurrency); prompt caches "
             f"{'on (defaults)' if st['prompt_cache'] else 'off'}. agg tok/s = completion tokens / (last stream "
             f"end − first request sent), median over rounds; TTFT over all requests. Peak memory: "
             f"{st['memory_sources']}; MLX peak = mlxd /health's mlx_peak_bytes (since the model loaded).", ""]
    lines += table(res["blocks"])
    gaps = res.get("single_gaps")
    if gaps:
        lines += ["", f"Single mode, gap between queued requests (next request's first token − the previous one's "
                      f"end − a lone request's TTFT {gaps['lone_ttft_ms']:.1f} ms): p50 {gaps['p50_ms']:.1f} ms, "
                      f"p95 {gaps['p95_ms']:.1f} ms, max {gaps['max_ms']:.1f} ms over {gaps['n']} queued requests."]
    for arm in ("single", "batched"):
        seen = {c: b.get("max_observed_concurrency") for c, b in sorted(res["blocks"].get(arm, {}).items())}
        if any(v is not None for v in seen.values()):
            lines += ["", f"{LABEL[arm]}: the most requests in flight at once so far (/health "
                          f"max_observed_concurrency), after each client count: "
                          + ", ".join(f"{c} → {v}" for c, v in seen.items())]
    mark = {True: "MET", False: "NOT MET", None: "—"}
    lines += ["", "| goal | result | |", "|---|---|---|"]
    lines += [f"| {g['goal']} | {g['detail']} | {mark[g['met']]} |" for g in res["goals"]]
    for arm, err in res.get("errors", {}).items():
        lines.append(f"\n- {LABEL[arm]} failed: {err.splitlines()[0] if err else '?'}")
    for note in res.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines)


# --- measuring -----------------------------------------------------------------------------------

def add_agent_args(p: Any) -> None:
    """The options of a replay of several agents (agents_load.py, fault_replay.py)."""
    p.add_argument("--model", type=Path, help="an mlx-lm model folder (default: demo model a)")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=None, help="[engine] max_concurrency (default: --agents)")
    p.add_argument("--system-tokens", type=int, default=12000)
    p.add_argument("--turn-tokens", type=int, default=1700)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)


def agent_prompts(agents: int, system_tokens: int, turn_tokens: int, turns: int, count: Callable[[str], int],
                  seed: int = 0) -> tuple[list[str], list[list[str]]]:
    """Each agent's system prompt and its turns' user messages: make_prompt's,
    each distinct from its first word on (prompt k's seed is k)."""
    base = 1000 * seed
    systems = [make_prompt(base + i, system_tokens, count) for i in range(agents)]
    turns_of = [[make_prompt(base + 100 * (i + 1) + n, turn_tokens, count) for n in range(turns)]
                for i in range(agents)]
    return systems, turns_of


def token_counter(model: Path) -> tuple[Callable[[str], int], str]:
    """The model's tokenizer (tokenizer.json, via `tokenizers`), else ~4 characters a token."""
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        return (lambda text: len(tok.encode(text, add_special_tokens=False).ids)), "tokenizer.json"
    except Exception:  # noqa: BLE001 - no tokenizer.json, no tokenizers: estimate
        return (lambda text: max(1, len(text) // 4)), "estimate (4 characters a token)"


class MemoryWatch:
    """Polls a server's memory while a block runs: its RSS (psutil, every
    50 ms) and, where nvidia-smi works, its GPU memory (every 250 ms): the
    process's own figure, else the device's used memory over `gpu_baseline`."""

    def __init__(self, pid: int, gpu_baseline: int | None, health_url: str | None = None) -> None:
        self.pid, self.gpu_baseline = pid, gpu_baseline
        self.health_url = health_url  # given: the engine's own memory figures at the GPU peak (`at_gpu_peak`)
        self.at_gpu_peak: dict[str, Any] | None = None
        self.rss_peak = 0
        self.gpu_peak: int | None = None
        self.gpu_source: str | None = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._rss, daemon=True)]
        if gpu_baseline is not None:
            self._threads.append(threading.Thread(target=self._gpu, daemon=True))

    def __enter__(self) -> "MemoryWatch":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)

    def _rss(self) -> None:
        try:
            proc = psutil.Process(self.pid)
            while not self._stop.is_set():
                self.rss_peak = max(self.rss_peak, proc.memory_info().rss)
                self._stop.wait(0.05)
        except psutil.Error:
            pass

    def _engine_memory(self, gpu_bytes: int) -> dict[str, Any] | None:
        """What the engine says it holds (its latest sample) when the GPU figure peaked."""
        try:
            h = requests.get(self.health_url, timeout=2).json()
        except (requests.RequestException, ValueError):
            return None
        mem, pc = h.get("memory", {}), h.get("prompt_cache", {})
        return {"gpu_bytes": gpu_bytes, "mlx_active_bytes": mem.get("mlx_active_bytes"),
                "mlx_cache_bytes": mem.get("mlx_cache_bytes"), "prompt_cache_bytes": pc.get("memory_bytes"),
                "prompt_cache_writing_bytes": pc.get("writing_bytes"), "running": h.get("batch_size")}

    def _gpu(self) -> None:
        while not self._stop.is_set():
            by_pid = parse_compute_apps(nvidia_smi("--query-compute-apps=pid,used_memory") or "")
            if self.pid in by_pid:
                value, source = by_pid[self.pid], "GPU, nvidia-smi per process"
            else:  # in a container nvidia-smi may not see our pids
                used = gpu_used_bytes()
                value = None if used is None else max(0, used - self.gpu_baseline)
                source = "GPU, nvidia-smi device used − before start"
            if value is not None and (self.gpu_peak is None or value > self.gpu_peak):
                self.gpu_peak, self.gpu_source = value, source
                if self.health_url:
                    self.at_gpu_peak = self._engine_memory(value)
            self._stop.wait(0.25)

    def result(self) -> dict[str, Any]:
        return {"rss_peak_bytes": self.rss_peak or None, "gpu_peak_bytes": self.gpu_peak,
                "gpu_source": self.gpu_source}


def nvidia_smi(query: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_used_bytes() -> int | None:
    """The devices' used memory, summed (nvidia-smi), or None without one."""
    out = nvidia_smi("--query-gpu=memory.used")
    if not out or not out.strip():
        return None
    try:
        return sum(int(float(x) * MIB) for x in out.split())
    except ValueError:
        return None


def chat_payload(model_name: str, prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": model_name, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def to_req(client: int, tr: Trace) -> Req:
    return Req(client, tr.t0, tr.chunk_times[0] if tr.chunk_times else None, tr.t_end, tr.completion_tokens,
               tr.prompt_tokens, tr.cached_prompt_tokens, tr.chunk_times[-1] if tr.chunk_times else None)


def run_round(ways: list[HttpWay], payloads: list[bytes], timeout: float) -> list[Req]:
    """len(payloads) streams at once, started together; their timings."""
    n = len(payloads)
    barrier = threading.Barrier(n)
    out: list[Req | None] = [None] * n
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            barrier.wait(60)
            out[i] = to_req(i, ways[i].stream(CHAT, payloads[i], {"Content-Type": "application/json"}, timeout))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)] or errors
        raise BenchError(f"{ways[0].way}: {len(errors)} of {n} requests failed: {real[0]!r}")
    return [r for r in out if r is not None]


def engine_extra(max_queue: int, log_level: str = "info") -> dict[str, Any]:
    """[engine] settings beside the defaults: room and time for every queued client."""
    return {"max_queue": max_queue, "queue_timeout_s": 1800, "request_deadline_s": 3600, "log_level": log_level}


def engine_toml(model: Path, extra: dict[str, Any], prompt_cache: bool, max_queue: int,
                log_level: str = "info", prompt_cache_gib: float | None = None) -> str:
    """benchkit's one-model config with `extra` [engine] settings."""
    config = one_model_config(model)
    config["engine"].update(engine_extra(max_queue, log_level), **extra)
    if not prompt_cache:
        config["engine"]["prompt_cache"] = {"enabled": False}
    elif prompt_cache_gib is not None:  # squeezed, as beside a big model on a Mac
        config["engine"]["prompt_cache"] = {"memory_gib": prompt_cache_gib}
    return dumps(config)


def start_arm(arm: str, model: Path, workdir: Path, args: argparse.Namespace) -> tuple[Server, str]:
    """The arm's server, starting (not yet ready), and the model name to ask for."""
    if arm == "mlx_lm":
        port = free_port()
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model.resolve()), "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "WARNING", "--decode-concurrency", str(args.batch_size),
                "--prompt-concurrency", str(args.batch_size)]
        if not args.prompt_cache:
            argv += ["--prompt-cache-size", "0"]
        elif args.prompt_cache_gib is not None:
            argv += ["--prompt-cache-bytes", str(int(args.prompt_cache_gib * 2**30))]
        if args.prefill_step_size:
            argv += ["--prefill-step-size", str(args.prefill_step_size)]
        return spawn(LABEL[arm], argv, child_env(), workdir / "mlx_lm_server.log", port, "/v1/models"), \
            "default_model"
    extra: dict[str, Any] = {"max_concurrency": args.batch_size} if arm == "batched" else {}
    if args.max_prompt_tokens:
        extra["max_prompt_tokens"] = args.max_prompt_tokens
    if args.prefill_step_size:
        extra["prefill_step_size"] = args.prefill_step_size
    toml = engine_toml(model, extra, args.prompt_cache, max(8, max(args.clients_list)), args.engine_log_level,
                       args.prompt_cache_gib)
    return start_engine(workdir / f"home-{arm}", toml, workdir / f"engine-{arm}.log", name=LABEL[arm]), "default"


def engine_health(server: Server) -> dict[str, Any]:
    """mlxd's /health figures: memory (MLX's peak since the model loaded, the
    budget) and the most requests it has had in flight at once."""
    time.sleep(1.2)  # the idle worker samples its memory every second
    try:
        health = EngineHealth.from_json(requests.get(server.url + "/health", timeout=10).json())
    except (requests.RequestException, ValueError):
        return {}
    if health is None:
        return {}
    mem = health.memory.to_json() if health.memory else {}
    out = {k: mem.get(k) for k in ("mlx_peak_bytes", "mlx_active_bytes", "mlx_cache_bytes", "budget_bytes",
                                   "rss_bytes")}
    out["max_observed_concurrency"] = health.max_observed_concurrency
    return out


def bench_arm(arm: str, model: Path, workdir: Path, args: argparse.Namespace, prompts: dict[int, str],
              steps: list[Step], gpu: bool) -> dict[str, Any]:
    say(f"== {LABEL[arm]}")
    baseline = gpu_used_bytes() if gpu else None
    started = time.monotonic()
    server, model_name = start_arm(arm, model, workdir, args)
    ways: list[HttpWay] = []
    rounds: dict[int, list[list[Req]]] = {}
    memory: dict[int, dict[str, Any]] = {}
    concurrency: dict[int, int | None] = {}
    raw: list[dict[str, Any]] = []
    try:
        server.wait_ready(args.startup_timeout)
        say(f"   ready in {time.monotonic() - started:.1f}s (pid {server.proc.pid})")
        ways = [HttpWay(arm, server.url, model_name, server) for _ in range(max(args.clients_list))]
        run_round(ways[:1], [chat_payload(model_name, prompts[0], 4)], args.request_timeout)  # first-use costs
        for c in args.clients_list:
            block = [s for s in steps if s.clients == c]
            with MemoryWatch(server.proc.pid, baseline) as watch:
                for s in block:
                    if server.proc.poll() is not None:
                        raise BenchError(f"{server.name} died (exit {server.proc.returncode}):\n{server.log_tail()}")
                    reqs = run_round(ways[:c], [chat_payload(model_name, prompts[k], args.max_tokens) for k in s.ks],
                                     args.request_timeout)
                    t_start = min(r.t0 for r in reqs)
                    raw.append({"clients": c, "round": s.round, "warmup": s.warmup, "prompts": list(s.ks),
                                "requests": [{**asdict(r), **{f: None if getattr(r, f) is None else
                                                              round((getattr(r, f) - t_start) * 1e3, 3)
                                                              for f in ("t0", "t_first", "t_end")}}
                                             for r in reqs]})
                    agg, ttfts = aggregate_tok_s(reqs), [r.ttft for r in reqs]
                    tag = f"warmup {s.round + 1}/{args.warmup}" if s.warmup else f"round {s.round + 1}/{args.rounds}"
                    say(f"   {LABEL[arm]:13s} {c} client(s) {tag:12s} agg {fmt(agg):>7s} tok/s  TTFT p50 "
                        f"{fmt(ms(pctl(ttfts, 0.5))):>7s} ms p95 {fmt(ms(pctl(ttfts, 0.95))):>7s} ms  "
                        f"tokens {sum(r.completion_tokens for r in reqs)} "
                        f"(prompts {min(r.prompt_tokens for r in reqs)}–{max(r.prompt_tokens for r in reqs)})")
                    if not s.warmup:
                        rounds.setdefault(c, []).append(reqs)
            memory[c] = watch.result()
            if arm != "mlx_lm":
                health = engine_health(server)
                concurrency[c] = health.pop("max_observed_concurrency", None)
                memory[c].update(health)
            hm, src = headline_memory(memory[c])
            say(f"   {LABEL[arm]:13s} {c} client(s) peak memory {fmt_mib(hm)} ({src})"
                + (f", MLX peak {fmt_mib(memory[c].get('mlx_peak_bytes'))} of budget "
                   f"{fmt_mib(memory[c].get('budget_bytes'))}, at most {concurrency.get(c)} request(s) in flight "
                   "so far" if memory[c].get("mlx_peak_bytes") else ""))
    finally:
        for w in ways:
            w.close()
        stop_child(server.proc)
    blocks = {c: {**summarize_block(rs), "memory": memory.get(c), "max_observed_concurrency": concurrency.get(c)}
              for c, rs in rounds.items()}
    return {"blocks": blocks, "rounds": rounds, "raw": raw}


# --- the command ---------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, metavar="PATH", help="an mlx-lm model folder (default: a demo model)")
    p.add_argument("--variant", default="a", choices=variants(), help="the demo model without --model (a)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                   help=f"where demo models are built ({DEFAULT_CACHE})")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)} (all)")
    p.add_argument("--clients", default="1,2,4,8", help="client counts (1,2,4,8)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per client count (3); medians")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds before them (1)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens per request (256)")
    p.add_argument("--prompt-tokens", type=int, default=1000, help="tokens per prompt, about (1000)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="batched mlxd's max_concurrency and mlx_lm.server's decode/prompt concurrency (8)")
    p.add_argument("--prompt-cache-gib", type=float, default=None, metavar="G",
                   help="the prompt cache's memory (mlxd memory_gib, mlx_lm --prompt-cache-bytes): a squeezed cache")
    p.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                   help="turn both servers' prompt caches off (default: left on, as configured by default)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for a server to become ready")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="read timeout of one stream (s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results ({DEFAULT_OUT})")
    p.add_argument("--memory-total-gib", type=float, default=None,
                   help="the memory mlxd's budget is taken from (MLXD_MEMORY_TOTAL_BYTES): e.g. the GPU's, to show "
                        "memory admission against a server whose batch is unbounded")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="mlxd's [engine] max_prompt_tokens (long runs)")
    p.add_argument("--prefill-step-size", type=int, default=None,
                   help="mlxd's [engine] prefill_step_size and mlx_lm.server's --prefill-step-size (each its default)")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy the servers' logs into this folder")
    p.add_argument("--engine-log-level", choices=["info", "debug"], default="info",
                   help="mlxd's log level (debug: where each request's time went)")
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        p.error(f"--arms: choose from {','.join(ARMS)}")
    args.arms_list = arms
    try:
        args.clients_list = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    except ValueError:
        p.error("--clients: comma-separated integers")
    if not args.clients_list or args.clients_list[0] < 1:
        p.error("--clients: at least one count, each >= 1")
    if args.rounds < 1 or args.warmup < 0 or args.max_tokens < 1 or args.prompt_tokens < 1 or args.batch_size < 1:
        p.error("need --rounds >= 1, --warmup >= 0, --max-tokens, --prompt-tokens, --batch-size >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    interrupt_on_sigterm()
    started = time.monotonic()
    if args.memory_total_gib:  # read by the engines this process starts
        os.environ["MLXD_MEMORY_TOTAL_BYTES"] = str(int(args.memory_total_gib * 2**30))
    if args.model:
        if not (args.model / "config.json").is_file():
            say(f"error: {args.model} is not an mlx-lm model folder (no config.json)")
            return 1
        name, model = args.model.resolve().name, args.model.resolve()
    else:
        name, model = demo_model(args.variant, args.cache_dir)
    info = machine_info()
    gpu = gpu_used_bytes() is not None
    count, count_source = token_counter(model)
    steps = plan(args.clients_list, args.rounds, args.warmup)
    ks = [0] + [k for s in steps for k in s.ks]
    prompts = {k: make_prompt(k, args.prompt_tokens if k else 16, count) for k in ks}
    say(f"{len(prompts)} distinct prompts of ~{args.prompt_tokens} tokens ({count_source}); "
        f"{'GPU' if gpu else 'CPU'}: {info.get('gpu') or info.get('cpu')}")
    settings = {"model": name, "model_path": str(model), "arms": args.arms_list, "clients": args.clients_list,
                "rounds": args.rounds, "warmup": args.warmup, "max_tokens": args.max_tokens,
                "prompt_tokens": args.prompt_tokens, "prompt_token_count": count_source,
                "batch_size": args.batch_size, "prompt_cache": args.prompt_cache, "prompt_cache_gib": args.prompt_cache_gib,
                "endpoint": f"{CHAT} (stream, include_usage), temperature 0",
                "memory_sources": ("nvidia-smi, the server process's used GPU memory (or the device's used memory "
                                   "over its level before the server started), polled every 250 ms") if gpu else
                                  "the server process's RSS, polled every 50 ms",
                "engine_toml_extra": table_lines(engine_extra(max(8, max(args.clients_list))))
                                     + "(batched: max_concurrency = "
                                     f"{args.batch_size})",
                "memory_total_gib": args.memory_total_gib, "max_prompt_tokens": args.max_prompt_tokens,
                "prefill_step_size": args.prefill_step_size,
                "order": "arms one after another (one server at a time), client counts ascending, rounds in turn"}
    per_arm: dict[str, Any] = {}
    errors: dict[str, str] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="mlxd-bench-") as tmp:
            for arm in args.arms_list:
                try:
                    per_arm[arm] = bench_arm(arm, model, Path(tmp), args, prompts, steps, gpu)
                except BenchError as exc:
                    say(f"   {LABEL[arm]} failed: {exc}")
                    errors[arm] = str(exc)
                finally:
                    if args.keep_logs:  # the servers' logs (with --engine-log-level debug: each request's moments)
                        args.keep_logs.mkdir(parents=True, exist_ok=True)
                        for log_file in Path(tmp).glob("*.log"):
                            shutil.copy(log_file, args.keep_logs / log_file.name)
    except KeyboardInterrupt:
        say("interrupted: stopping the servers")
        return 130
    finally:
        stop_all_children()
    blocks = {arm: r["blocks"] for arm, r in per_arm.items()}
    gaps = gap_summary(per_arm["single"]["rounds"]) if "single" in per_arm else None
    notes = []
    cached = {arm: max((b.get("cached_tokens_max") or 0) for b in bl.values()) for arm, bl in blocks.items() if bl}
    if any(v > 32 for v in cached.values()):
        notes.append(f"some prompt tokens came from a prompt cache (most per request: {cached})")
    if "single" in per_arm and gaps is None:
        notes.append("the single-mode gap needs the single arm at 1 client and at 2+ clients")
    settings["wall_s"] = round(time.monotonic() - started, 1)
    info["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results = {"blocks": blocks, "single_gaps": gaps, "goals": goals(blocks, gaps), "errors": errors,
               "notes": notes}
    doc = {"machine": info, "settings": settings, "results": results,
           "raw": {arm: r["raw"] for arm, r in per_arm.items()},
           "prompts": {str(k): {"start": v[:60], "chars": len(v), "tokens": count(v)} for k, v in prompts.items()}}
    write_json(args.out, doc)
    print(markdown(doc))
    say(f"\nevery request: {args.out} (total {settings['wall_s']:.0f}s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
