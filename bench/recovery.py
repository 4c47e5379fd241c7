"""Recovery benchmark: SIGABRT -> the engine answering again, under the real
supervisor (supervisord + runner + crash listener), split into phases.

  detection  kill -> the crash listener has handled the exit
  backoff    the listener's chosen delay (0 after a healthy run)
  spawn      end of backoff -> the new engine process exists
  load       engine process start -> ready (imports + model load)
  total      kill -> /health 200 from the new process

Each crash follows a healthy run (healthy_reset_s is set short), which is
the case the goal is about: <= 1 s plus model load. Run by hand:

  .venv/bin/python bench/recovery.py [--crashes 10] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from mlxd.paths import StatePaths, read_json
from mlxd.supervisor.journal import read_records

HEALTHY_RUN_S = 1.5


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.005)
    raise TimeoutError(what)


def health(url: str) -> dict | None:
    try:
        r = requests.get(url + "/health", timeout=1)
        return r.json() if r.status_code == 200 else None
    except requests.RequestException:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--crashes", type=int, default=10)
    ap.add_argument("--model", help="model folder (default: the built-in demo model)")
    ap.add_argument("--out", default="bench/results/recovery.json")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="mlxd-recovery-"))
    port = free_port()
    model = f'path = "{args.model}"' if args.model else 'demo = "a"'
    (home / "mlxd.toml").write_text(f"""
[engine]
port = {port}
[supervisor]
healthy_reset_s = {HEALTHY_RUN_S}
loop_crashes = 1000
health_interval_s = 0.5
[models.bench]
{model}
[aliases]
default = "bench"
""")
    env = {**os.environ, "MLXD_HOME": str(home)}
    env.pop("MLXD_CONFIG", None)
    mlxd = [sys.executable, "-m", "mlxd.cli"]
    url = f"http://127.0.0.1:{port}"
    paths = StatePaths(home)
    rows = []
    try:
        subprocess.run([*mlxd, "up", "--detach", "--timeout", "300"], env=env, check=True)
        for i in range(args.crashes):
            time.sleep(HEALTHY_RUN_S + 0.2)  # a healthy run first (benchmark pacing, not synchronisation)
            old = health(url)
            assert old, "engine not healthy before the crash"
            n_records = len(read_records(paths.journal))
            t_kill = time.time()
            os.kill(old["pid"], signal.SIGABRT)
            new = wait_for(lambda: (h := health(url)) and h["pid"] != old["pid"] and h, 120, "engine back")
            t_back = time.time()
            rec = wait_for(lambda: (r := read_records(paths.journal)) and len(r) > n_records and r[-1], 30,
                           "journal record")
            row = {
                "detection_s": rec["handled_at"] - t_kill,
                "backoff_s": rec["restart_in_s"],
                "spawn_s": new["process_started_at"] - (rec["handled_at"] + rec["restart_in_s"]),
                "load_s": new["ready_at"] - new["process_started_at"],
                "total_s": t_back - t_kill,
                "class": rec["class"],
            }
            rows.append(row)
            print(f"crash {i + 1}/{args.crashes}: " + "  ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    finally:
        subprocess.run([*mlxd, "down"], env=env, timeout=120)
    keys = ["detection_s", "backoff_s", "spawn_s", "load_s", "total_s"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    print("\n| phase | median (s) | min | max |\n|---|---|---|---|")
    for k in keys:
        vals = [r[k] for r in rows]
        print(f"| {k[:-2]} | {med[k]:.3f} | {min(vals):.3f} | {max(vals):.3f} |")
    print(f"\ntotal minus load (goal <= 1 s): {med['total_s'] - med['load_s']:.3f} s "
          f"(median total {med['total_s']:.3f} s, of which load {med['load_s']:.3f} s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "python": platform.python_version()},
                               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "crashes": rows, "median": med},
                              indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
