"""The engine's reading of the listener's quarantine file (engine/api/quarantine.py):
refused requests, and suspects decoded alone; a file from before suspects reads as none."""

from __future__ import annotations

import json
import os

import pytest

from mlxd.engine.api.quarantine import QuarantineList
from mlxd.engine.model.errors import EngineError
from mlxd.records import Quarantine


@pytest.mark.parametrize("fingerprint, now, refused, suspect", [
    ("poison", 50.0, True, False),
    ("poison", 150.0, False, False),   # its period is over
    ("shared", 50.0, False, True),     # in flight at a crash with others: served, alone
    ("shared", 250.0, False, False),
    ("other", 50.0, False, False),
])
def test_quarantined_requests_are_refused_and_suspects_decoded_alone(tmp_path, fingerprint, now, refused, suspect):
    path = tmp_path / "quarantine.json"
    Quarantine({"poison": 100.0}, suspects={"shared": 200.0}).write(path)
    q = QuarantineList(path)
    if refused:
        with pytest.raises(EngineError) as e:
            q.check(fingerprint, now=now)
        assert e.value.status == 400 and e.value.code == "request_quarantined"
    else:
        q.check(fingerprint, now=now)
    assert q.suspect(fingerprint, now=now) is suspect


def test_a_file_from_before_suspects_and_none_at_all(tmp_path):
    path = tmp_path / "quarantine.json"
    q = QuarantineList(path)
    assert q.suspect("x", now=0.0) is False  # no file: nothing refused, nobody suspected
    path.write_text(json.dumps({"fingerprints": {"x": 100.0}}))
    os.utime(path, (1, 1))
    assert q.suspect("x", now=0.0) is False
    with pytest.raises(EngineError):
        q.check("x", now=0.0)
