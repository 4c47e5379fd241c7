"""bench/step_log.py reads an engine's debug log into steps and the gaps between them (pure, a table)."""

from __future__ import annotations

import pytest

from testkit import load_bench

read = load_bench("step_log").read

LOG = """\
2026-12-07 10:00:00,000 DEBUG mlxd.engine.core.worker: batch step 20.0 ms: 4 tokens decoded, 4 rows in the batch
2026-12-07 10:00:00,030 DEBUG mlxd.engine.core.worker: batch step 25.0 ms: 3 tokens decoded, 512 prompt tokens, 4 rows in the batch
2026-12-07 10:00:00,250 DEBUG mlxd.engine.core.worker: batch step 20.0 ms: 4 tokens decoded, 0 prompt tokens, 4 rows in the batch
2026-12-07 10:00:00,270 INFO mlxd.engine.core.worker: something else
2026-12-07 10:00:20,000 DEBUG mlxd.engine.core.worker: batch step 10.0 ms: 1 tokens decoded, 1 rows in the batch
"""


@pytest.mark.parametrize("stall_s, stalls", [(0.02, [0.2]), (0.001, [0.005, 0.2]), (0.5, [])])
def test_steps_and_gaps(stall_s, stalls):
    log = read(LOG.splitlines(), idle_s=5.0)
    assert (log.steps, log.mixed_steps, log.prompt_tokens, log.tokens) == (4, 1, 512, 12)
    assert log.step_s == pytest.approx(0.075, abs=1e-4)
    # gaps: 30-25-0 = 5 ms, 250-20-30 = 200 ms; the 20 s one is the engine idle, not a stall
    assert log.gaps == pytest.approx([0.005, 0.2], abs=1e-4)
    assert log.stalls(stall_s) == pytest.approx(stalls, abs=1e-4)
