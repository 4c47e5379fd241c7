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

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from mlxd.devkit.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (bench/run.py, tests)
from benchkit import (DEFAULT_CACHE, DEFAULT_PROMPT, RESULTS, BenchError, HttpWay, Sample, Server, Trace,  # noqa: E402
                      busy_cpu_s, child_env, chosen, demo_model, interrupt_on_sigterm, machine_info, median, now,
                      one_model_config, say, spawn, start_engine, stop_all_children, stop_child, to_sample, variants,
                      write_json)

DEFAULT_OUT = RESULTS / "engine_overhead.json"
WAYS = ("inproc", "engine", "mlx_lm")
LABEL = {"inproc": "in-process", "engine": "mlxd engine", "mlx_lm": "mlx_lm.server"}


def measure(runner: "InProcess | HttpWay", prompt: str, max_tokens: int) -> Trace:
    """One run, with CPU accounting: the generating process, the client and
    the rest of the machine."""
    server = psutil.Process(runner.server.proc.pid) if isinstance(runner, HttpWay) else None
    busy0, wall0 = busy_cpu_s(), now()
    srv0 = sum(server.cpu_times()[:2]) if server else 0.0
    me0 = time.process_time()
    tr = runner.run(prompt, max_tokens)
    me = time.process_time() - me0
    srv = sum(server.cpu_times()[:2]) - srv0 if server else 0.0
    busy, wall = busy_cpu_s() - busy0, now() - wall0
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


# --- mlx_lm.server ------------------------------------------------------------------

def start_mlx_lm(model_path: Path, workdir: Path, prompt_cache: bool) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_path.resolve()), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "WARNING"]
    if not prompt_cache:
        argv += ["--prompt-cache-size", "0"]  # every request prefills its prompt, as the other two do
    return spawn("mlx_lm.server", argv, child_env(), workdir / "mlx_lm_server.log", port, "/v1/models")


# --- statistics and output -----------------------------------------------------------------

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
        out[way] = {"runs": len(ss), "decode_tok_s_median": median(dec), "decode_tok_s_min": min(dec),
                    "decode_tok_s_max": max(dec), "ttft_ms_median": median(ttft), "ttft_ms_min": min(ttft),
                    "ttft_ms_max": max(ttft), "total_s_median": median([s.total_s for s in ss]),
                    "server_cpu_us_per_token_median": median([s.server_cpu_us_per_token for s in ss]),
                    "client_cpu_us_per_token_median": median([s.client_cpu_us_per_token for s in ss]),
                    "background_cores_median": median([s.background_cores or 0.0 for s in ss]),
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
            st["decode_ratio_paired_median"] = median(paired)
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
                engine = start_engine(workdir / "mlxd-home", one_model_config(model_path), workdir / "engine.log")
                servers.append(engine)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", type=Path, metavar="PATH",
                   help="an mlx-lm model folder (repeatable); default: the demo models")
    p.add_argument("--variant", action="append", choices=variants(),
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
    args.ways_list = chosen(p, "--ways", args.ways, WAYS)
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
    return [demo_model(v, args.cache_dir) for v in args.variant or ["a", "b"]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    interrupt_on_sigterm()
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
    write_json(args.out, {"machine": info, "settings": settings, "results": results})
    print(markdown(results, settings, info))
    say(f"\nraw samples: {args.out} (total {settings['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
