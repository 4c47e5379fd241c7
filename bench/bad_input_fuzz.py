#!/usr/bin/env python3
"""Long bad-input fuzz run of the engine and the gateway, with a summary.

Runs the fuzz tests (tests/fuzz/) with MLXD_FUZZ_EXAMPLES examples per test
(the CI default is a few dozen), records every request they make, then
prints: requests per endpoint, the status-code histogram, responses >= 500
(unexpected ones must be 0; those of reported gateway bugs are counted
apart), engine restarts (must be 0) and RSS before/after.

    .venv/bin/python bench/bad_input_fuzz.py                   # 300 examples per test, engine and gateway
    .venv/bin/python bench/bad_input_fuzz.py --examples 2000 --only engine
    .venv/bin/python bench/bad_input_fuzz.py --known-bugs      # also send inputs of reported bugs

Exit status: 0 when pytest passed and no unexpected 5xx was seen, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = {"engine": "tests/fuzz/test_engine_fuzz.py", "gateway": "tests/fuzz/test_gateway_fuzz.py"}


def run(examples: int, only: list[str], known_bugs: bool, stats: Path, extra: list[str]) -> tuple[int, float]:
    env = {**os.environ, "MLXD_FUZZ_EXAMPLES": str(examples), "MLXD_FUZZ_STATS": str(stats), "MLXD_FUZZ_RANDOM": "1",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1"}
    if known_bugs:
        env["MLXD_FUZZ_KNOWN_BUGS"] = "1"
    python = ROOT / ".venv" / "bin" / "python"
    cmd = [str(python if python.exists() else sys.executable), "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *[FILES[o] for o in only], *extra]
    print("$", " ".join(cmd), f"(MLXD_FUZZ_EXAMPLES={examples})", flush=True)
    started = time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    return rc, time.monotonic() - started


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def summarise(stats: Path) -> dict:
    requests: list[dict] = []
    notes: list[dict] = []
    for line in stats.read_text().splitlines() if stats.exists() else []:
        rec = json.loads(line)
        (requests if rec["kind"] == "request" else notes).append(rec)
    per_endpoint: Counter = Counter()
    per_document: Counter = Counter()  # schemathesis's requests, generated from each target's OpenAPI document
    histogram: dict[str, Counter] = defaultdict(Counter)
    five: Counter = Counter()
    for r in requests:
        per_endpoint[(r["target"], r["endpoint"])] += 1
        if r.get("openapi"):
            per_document[r["target"]] += 1
        histogram[r["target"]][str(r["status"])] += 1
        if r["status"] is not None and r["status"] >= 500:
            five[r["target"]] += 1
    known = Counter(n["known_bug"] for n in notes if "known_bug" in n)
    neutralised = Counter(n["neutralised"] for n in notes if "neutralised" in n)
    rss: dict[str, dict] = defaultdict(dict)
    for n in notes:
        if "target" in n:
            rss[n["target"]].update({k: v for k, v in n.items() if k not in ("kind", "target")})
    return {"requests": len(requests), "per_endpoint": per_endpoint, "per_document": per_document,
            "histogram": histogram, "five": five,
            "known": known, "neutralised": neutralised, "rss": rss}


def report(s: dict, rc: int, seconds: float, examples: int) -> int:
    print(f"\n== bad-input fuzz: {examples} examples per test, {s['requests']} requests, {seconds:.0f} s, "
          f"pytest exit {rc}")
    print("\nrequests per endpoint")
    print(f"  {'target':<8} {'endpoint':<34} {'requests':>8}")
    for (target, endpoint), n in sorted(s["per_endpoint"].items()):
        print(f"  {target:<8} {endpoint:<34} {n:>8}")
    print("\nschemathesis: requests generated from each OpenAPI document (the engine's own, the gateway's), every "
          "response checked against it (a violation fails the run)")
    for target, n in sorted(s["per_document"].items()):
        print(f"  {target:<8} {n:>8}")
    print("\nstatus codes (None: the server closed the connection without an answer; xfail: the known bugs' "
          "reproductions)")
    for target, counts in sorted(s["histogram"].items()):
        print(f"  {target:<8} " + "  ".join(f"{code}: {n}" for code, n in sorted(counts.items())))
    known_5xx = sum(s["known"][k] for k in s["known"] if k.startswith("gateway_") and "shape" not in k)
    unexpected = (sum(n for t, n in s["five"].items() if t not in ("gateway", "xfail"))
                  + max(0, s["five"]["gateway"] - known_5xx))
    print("\nresponses >= 500")
    for target in sorted(s["histogram"]):
        print(f"  {target:<8} {s['five'][target]}")
    print(f"  of which reported gateway bugs (allowed): {known_5xx}   unexpected: {unexpected} (must be 0)")
    if s["known"] or s["neutralised"]:
        print("\nknown bugs met: " + ", ".join(f"{k} {n}" for k, n in sorted(s["known"].items())))
        print("inputs of known bugs neutralised: " + ", ".join(f"{k} {n}" for k, n in sorted(s["neutralised"].items())))
    print("\nprocesses")
    for target, r in sorted(s["rss"].items()):
        line = f"  {target:<8} engine RSS {mib(r.get('rss_before'))} -> {mib(r.get('rss_after'))}"
        if "gateway_rss_before" in r:
            line += f"; gateway RSS {mib(r.get('gateway_rss_before'))} -> {mib(r.get('gateway_rss_after'))}"
        line += f"; engine restarts {r.get('restarts', 'unknown (the run stopped early)')}"
        print(line)
    ok = rc == 0 and unexpected == 0 and all(r.get("restarts") == 0 for r in s["rss"].values())
    print("\nresult:", "OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=300, help="hypothesis examples per test (default 300)")
    parser.add_argument("--only", choices=sorted(FILES), action="append", help="engine or gateway (default both)")
    parser.add_argument("--known-bugs", action="store_true", help="send inputs of reported bugs too")
    parser.add_argument("--stats", type=Path, help="keep the per-request JSON lines here")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxd-fuzz-") as tmp:
        stats = args.stats or Path(tmp) / "stats.jsonl"
        stats.unlink(missing_ok=True)
        rc, seconds = run(args.examples, args.only or sorted(FILES), args.known_bugs, stats, args.pytest_args)
        return report(summarise(stats), rc, seconds, args.examples)


if __name__ == "__main__":
    sys.exit(main())
