#!/usr/bin/env python3
"""Gateway overhead: streamed chat completions direct to the engine vs through the gateway.

  direct    POST http://127.0.0.1:<engine port>/v1/chat/completions (no key)
  gateway   POST http://127.0.0.1:<gateway port>/v1/chat/completions with
            `Authorization: Bearer <$MLXD_HOME/key>` (our key guard + LiteLLM's proxy)

Both against one supervised stack started the way a user starts it
(`mlxd up --detach` with a throw-away MLXD_HOME), same model, same prompt,
greedy (temperature 0), fixed max_tokens (the demo models never emit EOS, so
every run generates exactly max_tokens tokens). The two ways alternate in
rounds (the first way swaps each round) after warmup runs; medians compared.

Metrics, defined as in bench/engine_overhead.py (both use bench/benchkit.py):
  TTFT            request sent -> first content-carrying chunk (non-empty delta.content)
  decode tok/s    (window - 1) / (t_last - t_first) over the first/last content chunks
  CPU             engine, gateway and client CPU per generated token (Linux:
                  /proc/PID/task/*/schedstat, ns), and the gateway's CPU per
                  streamed chunk
Each round also runs a 1-token pair (max_tokens 1, --no-short to skip): its
TTFT is the per-request latency alone, and its gateway CPU is the per-request
cost; the slope up to the stream runs is the per-chunk cost.
Also: time from `mlxd up --detach` to ready (engine /health 200 AND an
authenticated chat completion through the gateway answered 200), median of
--ready-runs fresh starts, each in a new MLXD_HOME.

Usage:
  .venv/bin/python bench/gateway_overhead.py            # about 75 s on 2 cores
  .venv/bin/python bench/gateway_overhead.py --quick    # about 40 s
  .venv/bin/python bench/gateway_overhead.py --max-background 0.3   # re-run pairs disturbed by other programs

Progress goes to stderr (one line per run), the Markdown table to stdout,
everything (machine, versions, settings, raw samples) to --out (JSON). The
stack is stopped with `mlxd down` in a `finally` (on Ctrl-C and SIGTERM too),
then its leftover pids are killed; after a SIGKILL of the benchmark, run
`MLXD_HOME=<the home it printed> mlxd down`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import requests

from mlxd.devkit.ports import free_port
from mlxd.devkit.stack import MLXD, Stack

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py)
import benchkit as bk  # noqa: E402
from benchkit import BenchError, now, say  # noqa: E402

DEFAULT_OUT = bk.RESULTS / "gateway_overhead.json"
WAYS = ("direct", "gateway")
LABEL = {"direct": "direct to engine", "gateway": "through gateway"}


# --- the client -------------------------------------------------------------------------

class ChatWay(bk.HttpWay):
    """benchkit's minimal-work streaming client, on /v1/chat/completions
    (its SSE parser already reads `delta.content`)."""

    def __init__(self, way: str, url: str, model_name: str, key: str | None) -> None:
        super().__init__(way, url, model_name, server=None)  # type: ignore[arg-type]
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    def run(self, prompt: str, max_tokens: int, read_timeout: float = 300.0) -> bk.Trace:
        payload = json.dumps({"model": self.model_name, "messages": [{"role": "user", "content": prompt}],
                              "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                              "stream_options": {"include_usage": True}}).encode()
        return self.stream("/v1/chat/completions", payload, self.headers, read_timeout)


@dataclass
class GwSample(bk.Sample):
    # Sample's server_cpu_us_per_token is the engine's here.
    kind: str = "stream"  # "stream" (max_tokens N) or "short" (max_tokens 1: the per-request cost)
    gateway_cpu_ms: float = 0.0  # the gateway's CPU during the run
    gateway_cpu_us_per_token: float = 0.0
    gateway_cpu_us_per_chunk: float = 0.0  # per content chunk streamed


def _cpu_s(p: psutil.Process | None) -> float:
    """CPU seconds of a process. On Linux from /proc/PID/task/*/schedstat
    (nanoseconds, summed over its threads): psutil's clock ticks (10 ms) are
    too coarse for a few hundred microseconds per chunk. A thread that exits
    during a run takes its share with it; the gateway's threads are pooled."""
    if p is None:
        return 0.0
    if _SCHEDSTAT:
        total = 0
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            tids = []
        for tid in tids:
            try:
                with open(f"/proc/{p.pid}/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        if total:
            return total / 1e9
    t = p.cpu_times()
    return t.user + t.system


_SCHEDSTAT = os.path.exists("/proc/self/schedstat")


def measure(runner: ChatWay, prompt: str, max_tokens: int, engine: psutil.Process,
            gateway: psutil.Process) -> tuple[bk.Trace, float]:
    """One run with CPU accounting: engine, gateway (even for direct runs: it
    should be idle then), this client and the rest of the machine."""
    busy0, wall0 = bk.busy_cpu_s(), now()
    e0, g0, me0 = _cpu_s(engine), _cpu_s(gateway), time.process_time()
    tr = runner.run(prompt, max_tokens)
    me = time.process_time() - me0
    e, g = _cpu_s(engine) - e0, _cpu_s(gateway) - g0
    busy, wall = bk.busy_cpu_s() - busy0, now() - wall0
    tr.server_cpu_s, tr.client_cpu_s = e, me
    tr.background_cores = max(0.0, busy - e - g - me) / wall if wall > 0 else None
    return tr, g


def to_sample(tr: bk.Trace, gw_cpu_s: float, model: str, way: str, rnd: int, warm: bool, kind: str) -> GwSample:
    s = bk.to_sample(tr, model, way, rnd, warm, {})
    return GwSample(**asdict(s), kind=kind, gateway_cpu_ms=gw_cpu_s * 1e3,
                    gateway_cpu_us_per_token=gw_cpu_s / max(tr.completion_tokens, 1) * 1e6,
                    gateway_cpu_us_per_chunk=gw_cpu_s / max(len(tr.chunk_times), 1) * 1e6)


# --- the stack (`mlxd up --detach` ... `mlxd down`) --------------------------------------------

def new_stack(home: Path, model_path: Path) -> Stack:
    """The stack in `home` on free ports; its Ollama fallback is "down"
    (nothing listens on its port), and no fault injection."""
    closed = free_port()
    return Stack.create(home, model_path.resolve(), model_name="bench", engine="max_tokens_cap = 100000\n",
                        gateway=f'ollama_url = "http://127.0.0.1:{closed}"\n', env={"PYTHONUNBUFFERED": "1"},
                        faults=False)


def gateway_answers(stack: Stack) -> bool:
    """An authenticated chat completion through the gateway answers 200."""
    try:
        r = requests.post(stack.gateway_url + "/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {stack.key}"},
                          json={"model": "default", "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 1, "temperature": 0.0})
        return r.status_code == 200
    except (OSError, requests.RequestException):  # OSError: no key yet
        return False


def timed_up(stack: Stack, timeout: float) -> dict[str, float]:
    """`mlxd up --detach`, polled from outside: seconds from launching it to
    the engine's /health answering 200, to the gateway answering an
    authenticated chat completion with 200, and to `up` returning."""
    log = stack.home / "up.log"
    marks: dict[str, float] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set() and ("engine" not in marks or "gateway" not in marks):
            if "engine" not in marks and stack.healthy():
                marks["engine"] = now()
            if "gateway" not in marks and gateway_answers(stack):
                marks["gateway"] = now()
            time.sleep(0.05)

    t0 = now()
    with log.open("wb") as f:
        proc = subprocess.Popen([*MLXD, "up", "--detach", "--timeout", str(int(timeout))], env=stack.env,
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        rc = proc.wait(timeout + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = -1
    marks["up_returned"] = now()
    if rc != 0:
        stop.set()
        raise BenchError(f"`mlxd up --detach` exited {rc}:\n{log.read_text(errors='replace')[-3000:]}\n"
                         f"{stack.log_tail()}")
    poller.join(timeout)
    stop.set()
    if "engine" not in marks or "gateway" not in marks:
        raise BenchError(f"the stack was not ready {timeout:.0f}s after `mlxd up --detach`:\n{stack.log_tail()}")
    out = {k: marks[k] - t0 for k in ("engine", "gateway", "up_returned")}
    out["ready"] = max(out["engine"], out["gateway"])
    return out


def timed_stop(stack: Stack) -> float:
    """Seconds for `mlxd down` (and killing by pid whatever it left)."""
    t0 = now()
    stack.stop()
    return now() - t0


# --- info, statistics, output ------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    info = bk.machine_info()
    for d in ("litellm", "litellm-proxy-extras", "litellm-enterprise", "httpx", "aiohttp", "openai", "orjson",
              "sse-starlette", "pydantic"):
        info["http_stack"][d] = bk.version(d)
    try:
        info["git"]["gateway_dirty"] = bool(subprocess.run(
            ["git", "-C", str(bk.ROOT), "status", "--porcelain", "--", "gateway"], capture_output=True, text=True,
            timeout=10).stdout.strip())
    except Exception:  # noqa: BLE001
        pass
    return info


def _way_stats(ss: list[GwSample]) -> dict[str, Any]:
    dec, ttft = [s.decode_tok_s for s in ss], [s.ttft_ms for s in ss]
    return {"runs": len(ss),
            "decode_tok_s_median": bk.median(dec), "decode_tok_s_min": min(dec), "decode_tok_s_max": max(dec),
            "ttft_ms_median": bk.median(ttft), "ttft_ms_min": min(ttft), "ttft_ms_max": max(ttft),
            "total_s_median": bk.median([s.total_s for s in ss]),
            "content_chunks_median": bk.median([s.content_chunks for s in ss]),
            "engine_cpu_us_per_token_median": bk.median([s.server_cpu_us_per_token for s in ss]),
            "gateway_cpu_ms_mean": statistics.fmean([s.gateway_cpu_ms for s in ss]),
            "gateway_cpu_us_per_token_median": bk.median([s.gateway_cpu_us_per_token for s in ss]),
            "gateway_cpu_us_per_chunk_median": bk.median([s.gateway_cpu_us_per_chunk for s in ss]),
            "client_cpu_us_per_token_median": bk.median([s.client_cpu_us_per_token for s in ss]),
            "background_cores_median": bk.median([s.background_cores or 0.0 for s in ss]),
            "completion_tokens": sorted({s.completion_tokens for s in ss}),
            "prompt_tokens": sorted({s.prompt_tokens for s in ss})}


def _compare(measured: list[GwSample], d: dict[str, Any], g: dict[str, Any]) -> dict[str, Any]:
    """Ratio of medians, and the median of per-round (paired) figures, which is
    steadier when the machine's speed drifts."""
    direct_by_round = {s.round: s for s in measured if s.way == "direct"}
    pairs = [(s, direct_by_round[s.round]) for s in measured if s.way == "gateway" and s.round in direct_by_round]
    return {"decode_ratio": g["decode_tok_s_median"] / d["decode_tok_s_median"],
            "decode_ratio_paired_median": bk.median([a.decode_tok_s / b.decode_tok_s for a, b in pairs]),
            "ttft_extra_ms": g["ttft_ms_median"] - d["ttft_ms_median"],
            "ttft_extra_ms_paired_median": bk.median([a.ttft_ms - b.ttft_ms for a, b in pairs])}


def summarize(samples: list[GwSample]) -> dict[str, Any]:
    """Per kind (stream, short) and way: medians over the measured runs; the
    gateway against direct; the gateway's CPU split into a per-request part
    (the 1-token runs) and a per-chunk part (the slope up to the stream runs)."""
    measured = [s for s in samples if not s.warmup]
    out: dict[str, Any] = {}
    for kind in ("stream", "short"):
        mk = [s for s in measured if s.kind == kind]
        st = {way: _way_stats([s for s in mk if s.way == way]) for way in WAYS if any(s.way == way for s in mk)}
        if "direct" in st and "gateway" in st:
            st["comparison"] = _compare(mk, st["direct"], st["gateway"])
        if st:
            out[kind] = st
    gs, gl = out.get("short", {}).get("gateway"), out.get("stream", {}).get("gateway")
    if gs and gl:
        stream = [s for s in measured if s.kind == "stream" and s.way == "gateway"]
        short = [s for s in measured if s.kind == "short" and s.way == "gateway"]
        chunks_l = statistics.fmean([s.content_chunks for s in stream])
        chunks_s = statistics.fmean([s.content_chunks for s in short])
        fixed = gs["gateway_cpu_ms_mean"]
        per_chunk = ((gl["gateway_cpu_ms_mean"] - fixed) / (chunks_l - chunks_s) * 1e3
                     if chunks_l > chunks_s else math.nan)
        out["gateway_cpu_model"] = {"per_request_ms": fixed, "per_chunk_us": per_chunk,
                                    "stream_request_ms": gl["gateway_cpu_ms_mean"], "stream_chunks": chunks_l}
    return out


def check_consistency(samples: list[GwSample]) -> list[str]:
    measured = [s for s in samples if not s.warmup]
    notes = []
    for kind in ("stream", "short"):
        mk = [s for s in measured if s.kind == kind]
        for what in ("prompt_tokens", "completion_tokens", "text_sha1"):
            vals = {(s.way, getattr(s, what)) for s in mk}
            if len({v for _, v in vals}) > 1:
                notes.append(f"{kind} runs: {what} differ between runs/ways: {sorted(vals)}")
    notes.append("decode window = completion tokens for both ways (no in-process reference here); both ways "
                 "produce the same text, so the window, and the ratio, is the same for both")
    return notes


def _fmt_range(st: dict[str, Any], key: str, fmt: str) -> str:
    return (f"{format(st[key + '_median'], fmt)} ({format(st[key + '_min'], fmt)}–{format(st[key + '_max'], fmt)})")


def markdown(res: dict[str, Any], settings: dict[str, Any], info: dict[str, Any]) -> str:
    hs = info["http_stack"]
    summ = res["summary"]
    stream = summ.get("stream", {})
    lines = [
        f"### Gateway overhead — {info['date']}" + (f" — {settings['label']}" if settings.get("label") else ""),
        "",
        f"{info['platform']}, {info['cpu_count']} CPUs ({info['cpu'] or '?'}), Python {info['python']}, "
        f"mlx {info['mlx']} ({info['mlx_device']}), litellm {hs.get('litellm')}, uvicorn {hs.get('uvicorn')} + "
        f"{'httptools' if hs.get('httptools') else 'h11'}, aiohttp {hs.get('aiohttp')}, httpx {hs.get('httpx')}",
        f"{res['model']}; streamed /v1/chat/completions, greedy, max_tokens {settings['max_tokens']}, "
        f"{settings['rounds']} rounds after {settings['warmup']} warmup(s) per way, first way alternating; "
        f"medians (min–max). CPU µs per generated token: engine / gateway / client.",
        "",
        "| way | decode tok/s | × direct | TTFT ms | TTFT vs direct | chunks | CPU µs/token engine / gateway / "
        "client | gateway µs/chunk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cmp_ = stream.get("comparison", {})
    for way in WAYS:
        st = stream.get(way)
        if not st:
            continue
        if way == "direct":
            ratio, extra, gw_chunk = "1.000", "—", "—"
        else:
            ratio = f"**{cmp_['decode_ratio']:.3f}** (paired {cmp_['decode_ratio_paired_median']:.3f})"
            extra = f"**{cmp_['ttft_extra_ms']:+.1f} ms** (paired {cmp_['ttft_extra_ms_paired_median']:+.1f})"
            gw_chunk = f"{st['gateway_cpu_us_per_chunk_median']:.0f}"
        lines.append(
            f"| {LABEL[way]} | {_fmt_range(st, 'decode_tok_s', '.1f')} | {ratio} | "
            f"{_fmt_range(st, 'ttft_ms', '.1f')} | {extra} | {st['content_chunks_median']:.0f} | "
            f"{st['engine_cpu_us_per_token_median']:.0f} / {st['gateway_cpu_us_per_token_median']:.0f} / "
            f"{st['client_cpu_us_per_token_median']:.0f} | {gw_chunk} |")
    short = summ.get("short", {})
    if short.get("comparison"):
        c, d_ttft, g_ttft = short["comparison"], short["direct"]["ttft_ms_median"], short["gateway"]["ttft_ms_median"]
        lines += ["", f"1-token requests (max_tokens 1, same rounds): TTFT direct {d_ttft:.1f} ms, through gateway "
                      f"{g_ttft:.1f} ms: **{c['ttft_extra_ms']:+.1f} ms** "
                      f"(paired {c['ttft_extra_ms_paired_median']:+.1f})."]
    model = summ.get("gateway_cpu_model")
    if model:
        lines += [f"Gateway CPU per request ≈ **{model['per_request_ms']:.1f} ms + {model['per_chunk_us']:.0f} µs "
                  f"per streamed chunk** ({model['stream_request_ms']:.1f} ms for a {settings['max_tokens']}-token "
                  f"stream of {model['stream_chunks']:.0f} chunks)."]
    if cmp_:
        r, t = cmp_["decode_ratio"], cmp_["ttft_extra_ms"]
        ok_r, ok_t = r >= settings["goal_ratio"], t <= settings["goal_ttft_ms"]
        lines += ["", f"Goal: throughput ≥ {settings['goal_ratio']}× direct: {r:.3f}× "
                      f"({'MET' if ok_r else 'NOT MET'}); TTFT ≤ +{settings['goal_ttft_ms']:g} ms: {t:+.1f} ms "
                      f"({'MET' if ok_t else 'NOT MET'})."]
    ready = res.get("ready")
    if ready and ready["runs"]:
        lines += ["", f"`mlxd up --detach` → ready (engine /health 200 and an authenticated chat completion through "
                      f"the gateway 200), median of {len(ready['runs'])} fresh starts:", "",
                  "| measure | median s | runs s |", "|---|---:|---|"]
        for key, label in (("engine", "engine healthy"), ("gateway", "gateway answers an authenticated request"),
                           ("ready", "**ready (both)**"), ("up_returned", "`mlxd up --detach` returned"),
                           ("down", "`mlxd down` took")):
            vals = [r[key] for r in ready["runs"]]
            lines.append(f"| {label} | {bk.median(vals):.2f} | {', '.join(f'{v:.2f}' for v in vals)} |")
    bg = max((st.get("background_cores_median", 0.0) for k, st in stream.items() if k in WAYS), default=0.0)
    if bg > 0.2:
        lines += ["", f"Warning: other programs used up to {bg:.2f} of {info['cpu_count']} CPU cores (median per "
                      "run) during the runs; the timings are noisy (the paired figures and the CPU columns are "
                      "steadier). `--max-background 0.3` re-runs disturbed rounds."]
    if res["notes"]:
        lines += [""] + [f"- note: {n}" for n in res["notes"]]
    return "\n".join(lines)


# --- the benchmark ---------------------------------------------------------------------------

def run_rounds(stack: Stack, name: str, args: argparse.Namespace) -> tuple[list[GwSample], list[GwSample]]:
    """Warmups, then rounds: each round runs the stream pair (direct and
    gateway, the first way alternating) and, unless --no-short, the 1-token
    pair in the same order. With --max-background, a pair during which other
    programs used more CPU than that is discarded and run again."""
    engine_pid = stack.engine_pid()
    gateway_pid = requests.get(stack.gateway_url + "/mlxd/health", timeout=5).json()["pid"]
    engine, gateway = psutil.Process(engine_pid), psutil.Process(gateway_pid)
    runners = {"direct": ChatWay("direct", stack.url, "default", None),
               "gateway": ChatWay("gateway", stack.gateway_url, "default", stack.key)}
    say(f"   engine pid {engine_pid} at {stack.url}, gateway pid {gateway_pid} at {stack.gateway_url}")
    kinds = [("stream", args.max_tokens)] + ([] if args.no_short else [("short", 1)])
    plan: list[tuple[str, int, bool, list[str]]] = []  # (kind, round, warmup, ways in order)
    for i in range(args.warmup):
        plan += [(kind, i, True, list(WAYS)) for kind, _ in kinds]
    for r in range(args.rounds):
        order = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
        plan += [(kind, r, False, order) for kind, _ in kinds]
    tokens = dict(kinds)
    samples: list[GwSample] = []
    discarded: list[GwSample] = []
    total, n = sum(len(p[3]) for p in plan), 0
    try:
        for kind, rnd, warm, order in plan:
            tries = 1 if warm or args.max_background is None else 1 + args.retries
            for attempt in range(tries):
                pair = []
                for way in order:
                    if not (engine.is_running() and gateway.is_running()):
                        raise BenchError("the engine or the gateway died:\n" + stack.log_tail())
                    tr, gw_cpu = measure(runners[way], args.prompt, tokens[kind], engine, gateway)
                    pair.append(to_sample(tr, gw_cpu, name, way, rnd, warm, kind))
                    time.sleep(args.pause)
                worst = max(s.background_cores or 0.0 for s in pair)
                if attempt + 1 == tries or worst <= args.max_background:
                    break
                discarded += pair
                say(f"   {kind} round {rnd + 1}: background load {worst:.2f} cores > {args.max_background}: "
                    "pair discarded, again in 2s")
                time.sleep(2.0)
            for s in pair:
                n += 1
                samples.append(s)
                tag = f"warmup {rnd + 1}/{args.warmup}" if warm else f"round {rnd + 1}/{args.rounds}"
                dec = "" if kind == "short" else f"decode {s.decode_tok_s:7.1f} tok/s  "
                say(f"   [{n:3d}/{total}] {tag:12s} {kind:6s} {LABEL[s.way]:16s} TTFT {s.ttft_ms:7.1f} ms  {dec}"
                    f"{s.prompt_tokens}+{s.completion_tokens} tok {s.content_chunks:3d} chunks {s.total_s:5.2f}s  "
                    f"CPU engine {s.server_cpu_us_per_token:5.0f} us/tok, gateway {s.gateway_cpu_ms:5.1f} ms "
                    f"({s.gateway_cpu_us_per_chunk:4.0f} us/chunk)  background {s.background_cores:.2f} cores")
    finally:
        for r in runners.values():
            r.close()
    return samples, discarded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, metavar="PATH", help="an mlx-lm model folder (default: demo model a)")
    p.add_argument("--variant", choices=bk.variants(), default="a", help="demo model when no --model (default a)")
    p.add_argument("--cache-dir", type=Path, default=bk.DEFAULT_CACHE,
                   help=f"where demo models are built ({bk.DEFAULT_CACHE})")
    p.add_argument("--rounds", type=int, help="measured rounds (default 15; --quick 5)")
    p.add_argument("--warmup", type=int, help="warmup runs per way (default 2)")
    p.add_argument("--max-tokens", type=int, help="tokens per run (default 256; --quick 128)")
    p.add_argument("--prompt", default=bk.DEFAULT_PROMPT, help="the user message")
    p.add_argument("--ready-runs", type=int, help="fresh `mlxd up --detach` starts timed to ready (default 3; "
                                                  "--quick 1)")
    p.add_argument("--no-short", action="store_true",
                   help="skip the 1-token runs (per-request TTFT and gateway CPU) that each round also makes")
    p.add_argument("--pause", type=float, default=0.1, help="seconds between runs (default 0.1)")
    p.add_argument("--max-background", type=float, metavar="CORES",
                   help="re-run a round's pair (up to --retries times) when other programs used more than CORES "
                        "CPU cores during it (default: keep every run)")
    p.add_argument("--retries", type=int, default=3, help="re-runs per pair for --max-background (default 3)")
    p.add_argument("--label", default="", help="a note for this run (e.g. the variant under test), in the "
                                               "table's title and the JSON")
    p.add_argument("--quick", action="store_true", help="fewer, shorter runs (about 40 s)")
    p.add_argument("--timeout", type=float, default=300.0, help="`mlxd up --timeout` (default 300)")
    p.add_argument("--goal-ratio", type=float, default=0.9, help="target gateway/direct decode ratio (0.9)")
    p.add_argument("--goal-ttft-ms", type=float, default=5.0, help="target extra TTFT in ms (5)")
    p.add_argument("--keep-home", action="store_true", help="keep the temporary MLXD_HOME (logs) and print it")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    a = p.parse_args(argv)
    a.rounds = a.rounds if a.rounds is not None else (5 if a.quick else 15)
    a.warmup = a.warmup if a.warmup is not None else 2
    a.max_tokens = a.max_tokens if a.max_tokens is not None else (128 if a.quick else 256)
    a.ready_runs = a.ready_runs if a.ready_runs is not None else (1 if a.quick else 3)
    if a.rounds < 1 or a.warmup < 0 or a.max_tokens < 2 or a.ready_runs < 0:
        p.error("need --rounds >= 1, --warmup >= 0, --max-tokens >= 2, --ready-runs >= 0")
    return a


def model_to_run(args: argparse.Namespace) -> tuple[str, Path]:
    if args.model:
        if not (args.model / "config.json").is_file():
            raise BenchError(f"{args.model} is not an mlx-lm model folder (no config.json)")
        return args.model.resolve().name, args.model.resolve()
    return bk.demo_model(args.variant, args.cache_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bk.interrupt_on_sigterm()
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    settings = {"max_tokens": args.max_tokens, "rounds": args.rounds, "warmup": args.warmup,
                "prompt": args.prompt, "sampling": {"temperature": 0.0}, "quick": args.quick,
                "endpoint": "/v1/chat/completions (stream, include_usage), model 'default'",
                "ready_runs": args.ready_runs, "pause_s": args.pause, "goal_ratio": args.goal_ratio,
                "label": args.label, "short_runs": not args.no_short, "max_background_cores": args.max_background,
                "pythonpath": os.environ.get("PYTHONPATH"),
                "goal_ttft_ms": args.goal_ttft_ms,
                "metrics": {"ttft": "request sent -> first chunk with non-empty delta.content",
                            "decode_tok_s": "(window - 1) / (t_last - t_first) over the first/last content "
                                            "chunks; window = completion_tokens",
                            "ready": "from launching `mlxd up --detach` to both: engine /health 200 and an "
                                     "authenticated non-streamed chat completion (max_tokens 1) through the "
                                     "gateway 200 (polled every 50 ms)"}}
    started = time.monotonic()
    res: dict[str, Any] = {}
    tmp = tempfile.mkdtemp(prefix="mlxd-gwbench-")
    stack: Stack | None = None
    try:
        info = machine_info()
        name, path = model_to_run(args)
        res["model"], res["model_path"] = name, str(path)
        # 1) throughput and TTFT, on one stack
        stack = new_stack(Path(tmp) / "home", path)
        say(f"== {name}: mlxd up --detach (MLXD_HOME {stack.home})")
        first = timed_up(stack, args.timeout)
        say(f"   stack ready in {first['ready']:.2f}s (engine {first['engine']:.2f}s, gateway "
            f"{first['gateway']:.2f}s, up returned {first['up_returned']:.2f}s)")
        samples, discarded = run_rounds(stack, name, args)
        first["down"] = timed_stop(stack)
        stack = None
        # 2) up -> ready: fresh starts, each with its own new MLXD_HOME and ports
        ready_runs = []
        for i in range(args.ready_runs):
            stack = new_stack(Path(tmp) / f"home-ready-{i + 1}", path)
            t = timed_up(stack, args.timeout)
            t["down"] = timed_stop(stack)
            stack = None
            ready_runs.append(t)
            say(f"   [ready {i + 1}/{args.ready_runs}] ready {t['ready']:.2f}s (engine healthy {t['engine']:.2f}s, "
                f"gateway authenticated 200 {t['gateway']:.2f}s, up returned {t['up_returned']:.2f}s; "
                f"down {t['down']:.2f}s)")
            time.sleep(1.0)
        res["summary"] = summarize(samples)
        res["notes"] = check_consistency(samples)
        res["ready"] = {"first_stack": first, "runs": ready_runs,
                        "median": {k: bk.median([r[k] for r in ready_runs]) for k in
                                   ("engine", "gateway", "ready", "up_returned", "down")} if ready_runs else None}
        res["samples"] = [asdict(s) for s in samples]
        res["discarded_samples"] = [asdict(s) for s in discarded]
    except KeyboardInterrupt:
        say("interrupted: stopping the stack")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        if stack is not None:
            stack.stop()
        if args.keep_home:
            say(f"MLXD_HOMEs kept under {tmp}")
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    settings["wall_s"] = round(time.monotonic() - started, 1)
    info["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    bk.write_json(args.out, {"machine": info, "settings": settings, "results": res})
    print(markdown(res, settings, info))
    say(f"\nraw samples: {args.out} (total {settings['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
