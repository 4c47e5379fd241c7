"""bench/fault_replay.py at small scale on the demo model: agents through the
real stack (supervisord, listener, engine, gateway; the Ollama stand-in),
the engine killed by SIGABRT every few seconds, against the same agents with
no fault. The promise: no turn lost, no request that had not started
answering failed, nobody quarantined for a crash from outside, and a turn
after a restart served from its conversation's KV on disk."""

from __future__ import annotations

import json

import pytest

from testkit import load_bench

pytestmark = [pytest.mark.timeout(600), pytest.mark.integration]
fr = load_bench("fault_replay")


def test_agents_lose_no_turn_to_engine_crashes(tmp_path, demo_models):
    out = tmp_path / "fault_replay.json"
    # The demo model answers a turn in ~0.2 s: a fault every 1.5 s (and ~2 s a restart) gives a few per run.
    assert fr.main(["--model", str(demo_models.a), "--agents", "2", "--system-tokens", "800", "--turn-tokens", "100",
                    "--turns", "8", "--max-tokens", "64", "--fault-every-s", "1.5", "--stuck-grace-s", "30",
                    "--request-timeout", "120", "--out", str(out)]) == 0  # homes in /tmp: a socket path has a short limit
    doc = json.loads(out.read_text())
    calm, faults = doc["arms"]["nofaults"], doc["arms"]["faults"]
    assert calm["kills"] == 0 and calm["turns_completed"] == 16 and calm["turns_lost"] == 0
    assert faults["kills"] >= 2 and len(faults["restart_s"]) >= 1, faults["kills"]
    assert faults["turns_lost"] == 0 and faults["turns_completed"] == 16
    assert faults["failed_before_answer"] == 0, [t["failures"] for t in faults["turns"]]  # carried across instead
    assert faults["quarantined"] == []  # killed from outside: nobody's fault
    after = [t for t in faults["turns"] if t["after_restart"] and not t["by_ollama"] and t["turn"] > 1]
    assert after and all(t["cached_tokens"] >= 0.5 * t["prompt_tokens"] for t in after), after  # from disk
    assert doc["faults_over_nofaults_turns_per_minute"] > 0
