#!/usr/bin/env python3
"""The benchmark suite: one command runs every benchmark and writes one report.

    .venv/bin/python bench/run.py --quick      # a few minutes on 2 CPU cores
    .venv/bin/python bench/run.py              # the full suite (~15-20 min on 2 cores)
    .venv/bin/python bench/run.py --only engine,gateway
    .venv/bin/python bench/run.py --only cpu         # Linux CPU: the default model before/after (issue 26)

Each benchmark is its own script in bench/ (run alone for more options); this
runner calls them in turn, each measuring its subject side by side with its
anchor in the same run (alternating runs, medians), and collects the headline
figures into one table:

  engine     streamed decode tok/s and TTFT: engine vs in-process mlx-lm vs mlx_lm.server
  gateway    through the gateway vs straight to the engine; `mlxd up` -> ready (cold start)
  recovery   SIGABRT -> serving again, by phase; requests failed meanwhile
  swap       model swap vs a cold load; peak and steady memory over the swaps
  cache      an agent's 10-turn conversation: TTFT and cached share per turn, with and without
             the prompt cache, vs mlx_lm.server, and across an engine SIGABRT (from disk)
  cpu        Linux CPU only: the real default model's prefill and decode tok/s before (reference
             BLAS, Q4_1) and after (OpenBLAS, float32), and a ~2,000-token prompt (bench/cpu_path.py)

Two model sizes: demo model a (~3M params: per-token overhead shows) and demo
model c (Qwen2.5-0.5B's layer shapes on the llama architecture, 0.36B params,
random weights: a real workload at a few tokens/s on 2 cores); --quick runs c
in the engine benchmark only. Models are built once into ~/.cache/mlxd-bench.

Output (--out-dir, default bench/results/suite/): every benchmark's own JSON,
suite.json (machine, versions, date, settings, figures), suite.md (the table),
and PNG plots when matplotlib is installed (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when imported by path (tests/bench)
import benchkit as bk  # noqa: E402

SECTIONS = ("engine", "gateway", "recovery", "swap", "cache", "cpu")
DEFAULT_OUT = bk.RESULTS / "suite"


@dataclass
class Figure:
    """One headline number with the anchor it was measured against in the same run."""
    benchmark: str
    model: str
    what: str
    value: float
    unit: str
    anchor: str = ""
    anchor_value: float | None = None
    ratio: float | None = None  # value / anchor_value, or the difference where unit says so
    goal: str = ""
    met: bool | None = None


# --- figures from each benchmark's JSON (pure) ---------------------------------------------------

def engine_figures(doc: dict) -> list[Figure]:
    out = []
    goal = doc["settings"]["goal_ratio"]
    for model, res in doc["results"].items():
        summ = res["summary"]
        base = summ.get("inproc")
        for way, label in (("engine", "mlxd engine"), ("mlx_lm", "mlx_lm.server")):
            st = summ.get(way)
            if not st or not base:
                continue
            # The median of per-round ratios: steadier than a ratio of medians when
            # the machine's speed drifts (a shared VM), as it does.
            ratio = st.get("decode_ratio_paired_median") or st["decode_ratio_vs_inproc"]
            out.append(Figure("engine", model, f"decode tok/s, {label}", st["decode_tok_s_median"], "tok/s",
                              "in-process mlx-lm", base["decode_tok_s_median"], ratio,
                              f"≥ {goal}×" if way == "engine" else "",
                              ratio >= goal if way == "engine" else None))
            out.append(Figure("engine", model, f"TTFT, {label}", st["ttft_ms_median"], "ms", "in-process mlx-lm",
                              base["ttft_ms_median"], st["ttft_ratio_vs_inproc"]))
    return out


def gateway_figures(doc: dict, goals: bool = True) -> list[Figure]:
    """goals: the issue's goals are for the tiny model, where per-token cost shows."""
    res, settings = doc["results"], doc["settings"]
    model = res["model"]
    summ = res["summary"]["stream"] if "stream" in res["summary"] else res["summary"]
    d, g = summ["direct"], summ["gateway"]
    paired = summ.get("comparison", {})  # per-round (paired) figures: see engine_figures
    ratio = paired.get("decode_ratio_paired_median") or g["decode_tok_s_median"] / d["decode_tok_s_median"]
    extra = paired.get("ttft_extra_ms_paired_median", g["ttft_ms_median"] - d["ttft_ms_median"])
    out = [Figure("gateway", model, "decode tok/s through the gateway", g["decode_tok_s_median"], "tok/s",
                  "straight to the engine", d["decode_tok_s_median"], ratio,
                  f"≥ {settings['goal_ratio']}×" if goals else "", ratio >= settings["goal_ratio"] if goals else None),
           Figure("gateway", model, f"TTFT through the gateway ({extra:+.1f} ms)", g["ttft_ms_median"], "ms",
                  "straight to the engine", d["ttft_ms_median"], g["ttft_ms_median"] / d["ttft_ms_median"],
                  f"≤ +{settings['goal_ttft_ms']:g} ms" if goals else "",
                  extra <= settings["goal_ttft_ms"] if goals else None)]
    ready = (res.get("ready") or {}).get("median")
    if ready:
        out.append(Figure("cold start", model, "`mlxd up --detach` → ready through the gateway", ready["ready"], "s",
                          "engine healthy", ready["engine"], ready["ready"] / ready["engine"]))
    return out


def recovery_figures(doc: dict) -> list[Figure]:
    """Per arm (bench/recovery.py: standby, afresh): crash -> serving against the weights' load, the phases,
    and what the clients saw."""
    model = Path(doc["settings"]["model"]).name
    out = []
    for name, arm in doc["arms"].items():
        med, c, section = arm["median"], arm["requests"], f"recovery ({name})"
        out.append(Figure(section, model, "SIGABRT → serving again", med["total_s"], "s", "weights' load alone",
                          med["weights_s"], med["total_s"] / med["weights_s"] if med["weights_s"] else None,
                          f"≤ weights + 1 s (+{arm['total_minus_weights_s']:.2f} s)", arm["total_minus_weights_s"] <= 1.0))
        for k in ("detection_s", "backoff_s", "spawn_s", "start_s", "mlx_lm_s", "index_s", "weights_s", "rest_s"):
            if k in med:  # the load's parts: from an engine that reports its timings
                out.append(Figure(section, model, f"  {k[:-2]}", med[k], "s"))
        out.append(Figure(section, model, f"requests failed during {len(arm['crashes'])} crashes", c.get("failed", 0),
                          "requests", "requests sent", c.get("sent", 0),
                          c.get("failed", 0) / c["sent"] if c.get("sent") else None, "0", c.get("failed", 0) == 0))
        for key, what in (("answered_by_engine", "answered by the engine"),
                          ("answered_by_ollama", "answered by the fallback"),
                          ("stream_cut_explicit", "streams cut mid-answer, with an explicit error")):
            out.append(Figure(section, model, f"  {what}", c.get(key, 0), "requests", "requests sent", c.get("sent", 0),
                              c.get(key, 0) / c["sent"] if c.get("sent") else None))
    return out


def swap_figures(doc: dict, models: tuple[str, str]) -> list[Figure]:
    out = []
    label = f"{models[0]} ⇄ {models[1]}"
    for key, name in zip(("a", "b"), models):
        mine = [r for r in doc["swaps"] if r["to"] == key]
        if not mine:
            continue
        swap_s = statistics.median(r["unload_s"] + r["load_s"] for r in mine)
        cold = doc["cold"][key]["load_s"]
        out.append(Figure("swap", name, "swap in (unload + load)", swap_s, "s", "cold load alone", cold,
                          swap_s / cold))
        steady = max(r["active_bytes"] for r in mine) / 2**20
        alone = doc["cold"][key]["active_bytes"] / 2**20
        out.append(Figure("swap", name, "steady memory after swapping in (MLX active, max)", steady, "MiB",
                          "the model loaded alone", alone, steady / alone if alone else None))
    largest = max(c["peak_bytes"] for c in doc["cold"].values())
    worst = max(r["peak_bytes"] for r in doc["swaps"])
    out.append(Figure("swap", label, f"peak memory over {len(doc['swaps'])} swaps", worst / 2**20, "MiB",
                      "larger model's own peak", largest / 2**20, doc["peak_ratio"], "≤ 1.05×",
                      doc["peak_ratio"] <= 1.05))
    growth = doc["rss_growth_bytes"] / 2**20
    out.append(Figure("swap", label, "RSS growth, 2nd half vs 1st half of the swaps", growth, "MiB", "", None, None,
                      "no growth (≤ 16 MiB)", growth <= 16))
    return out


def cache_figures(doc: dict, model: str) -> list[Figure]:
    """The prompt cache's headline figures (bench/prompt_cache.py), each
    against its anchor in the same run."""
    s = doc["summary"]
    ttft, turns = s["ttft_s"], doc["settings"]["turns"]
    last = str(turns) if str(turns) in ttft.get("cache", {}) else turns
    out = []
    if s.get("min_cached_fraction_from_turn_2") is not None:
        f = s["min_cached_fraction_from_turn_2"]
        out.append(Figure("prompt cache", model, "prompt tokens reused, turns 2+ (lowest)", f * 100, "%", "", None,
                          None, "≥ 95 %", f >= 0.95))
        c, n = ttft["cache"][last] * 1000, ttft["nocache"][last] * 1000
        out.append(Figure("prompt cache", model, f"turn-{turns} TTFT with the cache", c, "ms", "without the cache",
                          n, c / n, "≤ 0.05× on a GPU at ≥ 8k tokens"))
    if s.get("after_crash_over_cold") is not None:
        r = s["after_crash_over_cold"]
        out.append(Figure("prompt cache", model, "TTFT of the turn after a SIGABRT (from disk)",
                          r * 100, "% of cold", "", None, r, "≤ 0.25×", r <= 0.25))
    if s.get("after_crash_cached_fraction") is not None:
        f = s["after_crash_cached_fraction"]
        out.append(Figure("prompt cache", model, "prompt reused by the turn after a SIGABRT the moment an answer came",
                          f * 100, "%", "", None, None, "≥ 90 %", f >= 0.90))
    if s.get("write_behind_ttft_over_nodisk_from_turn_2") is not None:
        r = s["write_behind_ttft_over_nodisk_from_turn_2"]
        out.append(Figure("prompt cache", model, "turn TTFT with every turn written to disk behind it (median, turns 2+)",
                          r, "×", "the disk tier off", None, r, "≤ 1.05×", r <= 1.05))
    if s.get("cache_over_mlx_lm_from_turn_2") is not None:
        r = s["cache_over_mlx_lm_from_turn_2"]
        out.append(Figure("prompt cache", model, "turn-N TTFT vs mlx_lm.server's (median, turns 2+)", r, "×",
                          "", None, r, "≤ 1×", r <= 1.0))
    if s.get("decode_cache_over_nocache"):
        r = s["decode_cache_over_nocache"]
        out.append(Figure("prompt cache", model, "decode tok/s with vs without the cache", r, "×", "", None, r,
                          "≥ 0.97×", r >= 0.97))
    if s.get("interleaved_min_cached_fraction_from_turn_2") is not None:
        f = s["interleaved_min_cached_fraction_from_turn_2"]
        out.append(Figure("prompt cache", model, "3 interleaved conversations: reused, turns 2+ (lowest)", f * 100,
                          "%", "", None, None, "≥ 95 %", f >= 0.95))
    return out


def cpu_figures(doc: dict) -> list[Figure]:
    """The fast CPU path's headline figures (bench/cpu_path.py): prefill and
    decode tok/s after (OpenBLAS + float32) and with OpenBLAS alone, each
    against before (reference BLAS, Q4_1) in the same run; the long prompt."""
    res, settings = doc["results"], doc["settings"]
    model = Path(settings["model"]).stem
    summ, comp, goal = res["summary"], res["comparison"], settings["goals"]
    before = summ.get("before") or {}
    out = []
    for key, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s")):
        for arm, what in (("after", "after: OpenBLAS + float32"), ("blas-only", "OpenBLAS alone, Q4_1")):
            value = (summ.get(arm) or {}).get(f"{key}_median")
            if value is None:
                continue
            c = comp.get(arm) or {}
            ratio = c.get(f"{key}_ratio_paired") or c.get(f"{key}_ratio")  # paired: see engine_figures
            out.append(Figure("cpu", model, f"{label}, {what}", value, "tok/s", "before: reference BLAS, Q4_1",
                              before.get(f"{key}_median"), ratio,
                              f"≥ {goal[key]:g} tok/s" if arm == "after" else "",
                              value >= goal[key] if arm == "after" else None))
    arms = res["arms"]
    long_after = (arms.get("after") or {}).get("long")
    if long_after is not None:
        ok = bool(long_after.get("answered_by_engine")) and not long_after.get("health_not_ok")
        long_before = (arms.get("before") or {}).get("long") or {}
        b = long_before.get("time_s") if long_before.get("answered_by_engine") else None
        t = long_after.get("time_s")
        out.append(Figure("cpu", model, f"{long_after.get('prompt_tokens') or '~2,000'}-token prompt, after: "
                          f"HTTP {long_after.get('status')}", t if t is not None else math.nan, "s",
                          "before" if b else "", b, t / b if b and t else None,
                          "200 from the engine, /health ok throughout", ok))
    return out


# --- running the benchmarks ---------------------------------------------------------------------

def demo(variant: str) -> Path:
    return bk.demo_model(variant)[1]


def call(module: Any, argv: list[str]) -> int:
    """Run one benchmark's main(argv), its table to our stdout log, never
    letting one benchmark's failure stop the others."""
    bk.say(f"\n=== {module.__name__} {' '.join(argv)}")
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = module.main(argv)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the suite's output
        bk.say(f"   {module.__name__} failed: {type(exc).__name__}: {exc}")
        rc = 1
    finally:
        bk.stop_all_children()
    sys.stderr.write(buf.getvalue())
    return rc


def plan(args: argparse.Namespace) -> list[tuple[str, str, Callable[[], list[Figure]]]]:
    """(section, description, step) in running order; each step runs one
    benchmark and returns its figures."""
    import cpu_path
    import engine_overhead
    import gateway_overhead
    import prompt_cache
    import recovery
    import swap

    out_dir: Path = args.out_dir
    q = args.quick
    steps: list[tuple[str, str, Callable[[], list[Figure]]]] = []

    def load(name: str) -> dict:
        return json.loads((out_dir / name).read_text())

    def engine_step(variant: str, tokens: int, rounds: int) -> Callable[[], list[Figure]]:
        def step() -> list[Figure]:
            name = f"engine_overhead_{variant}.json"
            call(engine_overhead, ["--variant", variant, "--max-tokens", str(tokens), "--rounds", str(rounds),
                      "--out", str(out_dir / name)])
            return engine_figures(load(name))
        return step

    steps.append(("engine", "demo-a", engine_step("a", 256, 3 if q else 7)))
    steps.append(("engine", "demo-c", engine_step("c", 16 if q else 32, 1 if q else 3)))

    def gateway_step(variant: str, extra: list[str]) -> Callable[[], list[Figure]]:
        def step() -> list[Figure]:
            name = f"gateway_overhead_{variant}.json"
            call(gateway_overhead, ["--variant", variant, "--out", str(out_dir / name), *extra])
            return gateway_figures(load(name), goals=variant == "a")
        return step

    steps.append(("gateway", "demo-a", gateway_step("a", ["--quick", "--ready-runs", "2"] if q else [])))
    if not q:
        steps.append(("gateway", "demo-c", gateway_step("c", ["--max-tokens", "32", "--rounds", "3", "--warmup", "1",
                                                              "--ready-runs", "2", "--no-short"])))

    def recovery_step() -> list[Figure]:
        call(recovery, ["--crashes", "3" if q else "10", "--model", str(demo("a")),
                        "--out", str(out_dir / "recovery.json")])
        return recovery_figures(load("recovery.json"))

    steps.append(("recovery", "demo-a", recovery_step))

    def swap_step() -> list[Figure]:
        a, b = ("a", "b") if q else ("b", "c")
        call(swap, ["--swaps", "6" if q else "20", "--model-a", str(demo(a)), "--model-b", str(demo(b)),
                    "--out", str(out_dir / "swap.json")])
        return swap_figures(load("swap.json"), (f"demo-{a}", f"demo-{b}"))

    steps.append(("swap", "two models", swap_step))

    def cache_step(variant: str, extra: list[str]) -> Callable[[], list[Figure]]:
        def step() -> list[Figure]:
            name = f"prompt_cache_{variant}.json"
            call(prompt_cache, ["--model", str(demo(variant)), "--out", str(out_dir / name), *extra])
            return cache_figures(load(name), f"demo-{variant}")
        return step

    # The CPU prefills demo-a at a few hundred tok/s (the Linux CPU wheel's reference BLAS):
    # a 1500-token system prompt is what a 10-turn, 4-arm run allows here.
    steps.append(("cache", "demo-a", cache_step("a", ["--turns", "6", "--interleaved-turns", "2",
                                                      "--system-tokens", "800"] if q else [])))

    def cpu_step() -> list[Figure]:
        (out_dir / "cpu_path.json").unlink(missing_ok=True)  # never a previous run's figures
        # The full suite gives the long prompt to 'after' only: on the reference BLAS it takes minutes.
        call(cpu_path, (["--quick"] if q else ["--long-arms", "after"]) + ["--out", str(out_dir / "cpu_path.json")])
        return cpu_figures(load("cpu_path.json"))

    if linux_cpu():
        steps.append(("cpu", "SmolLM2-135M", cpu_step))
    elif "cpu" in args.only:
        bk.say("cpu: skipped: the fast CPU path is measured on Linux with MLX's CPU backend only")
    return [s for s in steps if s[0] in args.only]


def linux_cpu() -> bool:
    """Linux with MLX on its CPU backend: where bench/cpu_path.py applies."""
    if not sys.platform.startswith("linux"):
        return False
    import mlx.core as mx

    return mx.default_device() == mx.cpu


# --- report ------------------------------------------------------------------------------------

def _num(x: float | None, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if unit == "requests":
        return f"{x:.0f}"
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def markdown(figures: list[Figure], info: dict, settings: dict, errors: list[str]) -> str:
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    lines = [f"### Benchmark suite — {info['date']}{' (quick)' if settings['quick'] else ''}", "",
             f"{info['platform']}, {info['cpu_count']} CPUs ({info['cpu'] or '?'}){gpu}, Python {info['python']}, "
             f"mlx {info['mlx']} ({info['mlx_device']}), mlx-lm {info['mlx_lm']}, litellm {bk.version('litellm')}, "
             f"commit {(info.get('git') or {}).get('commit') or '?'}. Medians over alternating runs; each figure "
             "with its anchor measured in the same run; engine and gateway ratios are medians of per-round "
             "(paired) ratios.", "",
             "| benchmark | model | figure | value | anchor | anchor value | ratio | goal | met |",
             "|---|---|---|---:|---|---:|---:|---|:---:|"]
    for f in figures:
        met = "" if f.met is None else ("✅" if f.met else "❌")
        lines.append(f"| {f.benchmark} | {f.model} | {f.what} | {_num(f.value, f.unit)} {f.unit} | {f.anchor} | "
                     f"{_num(f.anchor_value, f.unit)} | {'' if f.ratio is None else f'{f.ratio:.3f}×'} | {f.goal} | "
                     f"{met} |")
    if errors:
        lines += [""] + [f"- **not measured:** {e}" for e in errors]
    return "\n".join(lines)


def plots(out_dir: Path) -> list[Path]:
    """PNG plots from the benchmarks' JSON files; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        bk.say("matplotlib is not installed: no plots (pip install -e '.[bench]')")
        return []
    made = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        made.append(out_dir / name)

    from engine_overhead import LABEL

    engine_docs = sorted(out_dir.glob("engine_overhead_*.json"))
    if engine_docs:
        fig, axes = plt.subplots(1, len(engine_docs), figsize=(5 * len(engine_docs), 3.6), squeeze=False)
        for ax, p in zip(axes[0], engine_docs):
            doc = json.loads(p.read_text())
            for model, res in doc["results"].items():
                ways = [w for w in ("inproc", "engine", "mlx_lm") if w in res["summary"]]
                vals = [res["summary"][w]["decode_tok_s_median"] for w in ways]
                ax.bar([LABEL[w] for w in ways], vals, color=["#888", "#2a7", "#c84"][:len(ways)])
                for i, v in enumerate(vals):
                    ax.text(i, v, f"{v / vals[0]:.3f}×", ha="center", va="bottom", fontsize=8)
                ax.set_title(f"decode tok/s — {model}", fontsize=9)
        save(fig, "engine_overhead.png")

    gw_docs = sorted(out_dir.glob("gateway_overhead_*.json"))
    if gw_docs:
        fig, axes = plt.subplots(len(gw_docs), 2, figsize=(9, 3.2 * len(gw_docs)), squeeze=False)
        for row, p in zip(axes, gw_docs):
            res = json.loads(p.read_text())["results"]
            samples = [s for s in res["samples"] if not s["warmup"] and s.get("kind", "stream") == "stream"]
            for ax, key, title in ((row[0], "ttft_ms", "TTFT ms"), (row[1], "decode_tok_s", "decode tok/s")):
                for way, color in (("direct", "#888"), ("gateway", "#27a")):
                    ys = [s[key] for s in samples if s["way"] == way]
                    ax.plot(range(1, len(ys) + 1), ys, "o-", color=color, ms=3, lw=1, label=way)
                ax.set_title(f"{title} per round — {res['model']}", fontsize=9)
                ax.set_xlabel("round", fontsize=8)
                ax.set_ylim(bottom=0)
            row[0].legend(fontsize=7)
        save(fig, "gateway_overhead.png")

    rec = out_dir / "recovery.json"
    if rec.exists():
        doc = json.loads(rec.read_text())
        arms = list(doc["arms"].items())
        fig, axes = plt.subplots(1, len(arms), figsize=(3.6 * len(arms), 3.4), squeeze=False, sharey=True)
        for ax, (name, arm) in zip(axes[0], arms):
            bottom = [0.0] * len(arm["crashes"])
            for k, color in zip(("detection_s", "backoff_s", "spawn_s", "load_s"), ("#c44", "#ca4", "#4ac", "#4a4")):
                vals = [r[k] for r in arm["crashes"]]
                ax.bar(range(1, len(vals) + 1), vals, bottom=bottom, color=color, label=k[:-2])
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_xticks(range(1, len(arm["crashes"]) + 1))
            ax.set_xlabel("crash", fontsize=8)
            ax.set_title(f"SIGABRT → serving, {name}", fontsize=9)
        axes[0][0].set_ylabel("seconds", fontsize=8)
        axes[0][0].legend(fontsize=7)
        save(fig, "recovery.png")

    sw = out_dir / "swap.json"
    if sw.exists():
        doc = json.loads(sw.read_text())
        fig, ax = plt.subplots(figsize=(7, 3.4))
        xs = range(1, len(doc["swaps"]) + 1)
        for key, label in (("active_bytes", "MLX active"), ("peak_bytes", "MLX peak"), ("rss_bytes", "RSS")):
            ax.plot(xs, [r[key] / 2**20 for r in doc["swaps"]], "o-", ms=3, lw=1, label=label)
        largest = max(c["peak_bytes"] for c in doc["cold"].values()) / 2**20
        ax.axhline(largest * 1.05, color="#c44", ls="--", lw=1, label="goal for the MLX peak: larger model's + 5 %")
        ax.set_xlabel("swap", fontsize=8)
        ax.set_ylabel("MiB", fontsize=8)
        ax.set_title("memory across alternating model swaps", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "swap_memory.png")

    for p in sorted(out_dir.glob("prompt_cache_*.json")):
        doc = json.loads(p.read_text())
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for arm, ttft in doc["summary"]["ttft_s"].items():
            turns = sorted(ttft, key=int)
            ax.plot([int(t) for t in turns], [ttft[t] * 1000 for t in turns], marker="o", ms=3, label=arm)
        ax.set_yscale("log")
        ax.set_xlabel("turn", fontsize=8)
        ax.set_ylabel("TTFT ms (median)", fontsize=8)
        ax.set_title(f"prompt cache: {p.stem.removeprefix('prompt_cache_')}", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, f"{p.stem}.png")
    return made


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer and shorter runs: a few minutes on 2 CPU cores")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help=f"where results go ({DEFAULT_OUT})")
    args = ap.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in args.only if s not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bk.interrupt_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    info = bk.machine_info()
    figures: list[Figure] = []
    errors: list[str] = []
    steps = plan(args)
    try:
        for n, (section, what, step) in enumerate(steps, 1):
            bk.say(f"\n##### [{n}/{len(steps)}] {section} ({what}) — {time.monotonic() - started:.0f}s elapsed")
            try:
                got = step()
                figures += got
                for f in got:
                    bk.say(f"   {f.benchmark} {f.model}: {f.what} = {_num(f.value, f.unit)} {f.unit}"
                           + (f" ({f.ratio:.3f}× {f.anchor})" if f.ratio is not None else ""))
            except (OSError, KeyError, ValueError, TypeError, ZeroDivisionError) as exc:
                errors.append(f"{section} ({what}): {type(exc).__name__}: {exc}")
                bk.say(f"   {section} ({what}) produced no figures: {exc}")
    except KeyboardInterrupt:
        bk.say("interrupted")
        bk.stop_all_children()
        return 130
    settings = {"quick": args.quick, "sections": args.only, "wall_s": round(time.monotonic() - started, 1)}
    md = markdown(figures, info, settings, errors)
    made = plots(args.out_dir)
    (args.out_dir / "suite.json").write_text(json.dumps(
        {"machine": info, "settings": settings, "figures": [asdict(f) for f in figures], "errors": errors,
         "plots": [p.name for p in made]}, indent=1, allow_nan=True) + "\n")
    (args.out_dir / "suite.md").write_text(md + "\n" + "".join(f"\n![{p.stem}]({p.name})\n" for p in made))
    print(md)
    bk.say(f"\nsuite: {args.out_dir / 'suite.md'}, {args.out_dir / 'suite.json'}, {len(made)} plot(s); "
           f"{settings['wall_s']:.0f}s")
    missed = [f for f in figures if f.met is False]
    return 1 if errors or missed else 0


if __name__ == "__main__":
    sys.exit(main())
