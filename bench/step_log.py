"""Where an engine's time went, from its debug log (`[engine] log_level =
"debug"`: a line a batch step, engine/model/batch_decoder.py): the steps,
those that carried prompt chunks (mixed steps), and the gaps between steps
while requests ran -- a stall every decoding row waits out.

    python bench/step_log.py ENGINE.log [--stall-ms 20]

A step's line is written when it ends and says how long it took, so a gap
is the next step's start (its line's time less its duration) after the
last one's end. Gaps longer than `--idle-s` are the engine with nothing to
do (between a benchmark's phases), not stalls.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*batch step ([\d.]+) ms: (\d+) tokens decoded"
                  r"(?:, (\d+) prompt tokens)?, (\d+) rows in the batch")


@dataclass
class StepLog:
    steps: int = 0
    step_s: float = 0.0
    mixed_steps: int = 0
    mixed_s: float = 0.0
    prompt_tokens: int = 0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # seconds between one step's end and the next one's start

    def stalls(self, over_s: float) -> list[float]:
        return [g for g in self.gaps if g > over_s]


def read(lines: list[str], idle_s: float = 5.0) -> StepLog:
    """The steps and gaps of a debug log's lines (pure)."""
    out = StepLog()
    last_end = None
    for line in lines:
        m = STEP.match(line)
        if not m:
            continue
        at = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        seconds = float(m[2]) / 1000
        out.steps += 1
        out.step_s += seconds
        out.tokens += int(m[3])
        if m[4] and int(m[4]):
            out.mixed_steps += 1
            out.mixed_s += seconds
            out.prompt_tokens += int(m[4])
        if last_end is not None:
            gap = max(0.0, at - seconds - last_end)
            if gap < idle_s:
                out.gaps.append(gap)
        last_end = at
    return out


def report(log: StepLog, stall_s: float) -> str:
    stalls = log.stalls(stall_s)
    plain = log.steps - log.mixed_steps
    lines = [
        "| steps | step time | mixed steps (prompt tokens) | mean plain step | mean mixed step | time between steps "
        f"| gaps > {stall_s * 1000:.0f} ms (their time) | longest gap |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {log.steps} | {log.step_s:.1f} s | {log.mixed_steps} ({log.prompt_tokens}) "
        f"| {1000 * (log.step_s - log.mixed_s) / max(1, plain):.1f} ms "
        f"| {1000 * log.mixed_s / max(1, log.mixed_steps):.1f} ms | {sum(log.gaps):.1f} s "
        f"| {len(stalls)} ({sum(stalls):.1f} s) | {1000 * max(log.gaps, default=0):.0f} ms |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path)
    p.add_argument("--stall-ms", type=float, default=20.0)
    p.add_argument("--idle-s", type=float, default=5.0)
    args = p.parse_args(argv)
    log = read(args.log.read_text(errors="replace").splitlines(), args.idle_s)
    if not log.steps:
        print(f"{args.log}: no batch steps (the engine's log level must be debug)", file=sys.stderr)
        return 1
    print(f"\n{args.log.name}:\n\n{report(log, args.stall_ms / 1000)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
