"""`mlxd models` (cli/models.py): the rows as a table of cases, and the command
on a config of real model folders (a demo model, a 70B description only, a
repo not downloaded), as a table and as JSON, with no engine running and with one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxd.cli.models import format_models
from mlxd.model_list import model_rows
from mlxd.config import parse_config
from mlxd.models import model_info
from mlxd.reports import EngineHealth
from mlxd.toml_text import dumps

MLXD = [sys.executable, "-m", "mlxd.cli"]
GIB = 2**30


@pytest.fixture
def config(tmp_path, demo_models):
    return parse_config({"models": {"demo-a": {"path": str(demo_models.a)}, "big": {"path": str(demo_models.heavy)},
                                    "later": {"repo": "mlx-community/Not-Downloaded-7B-4bit"}},
                         "aliases": {"default": "demo-a", "huge": "big"}}, tmp_path)


@pytest.mark.parametrize("health, states", [
    (None, ["?", "?", "?"]),                                                         # no engine answered
    (EngineHealth(status="ok", resident_model="demo-a"), ["loaded", "-", "-"]),
    (EngineHealth(status="ok", resident_model=None, unloaded_idle_at=1.0, unloaded_idle_model="demo-a"),
     ["idle, unloaded", "-", "-"]),
])
def test_a_row_per_model_with_what_the_engine_holds(config, health, states):
    infos = {m: model_info(config, m, 16 * GIB) for m in config.models}
    rows = model_rows(config, infos, {"demo-a": 123}, health)
    assert [r.id for r in rows] == ["demo-a", "big", "later"] and [r.state for r in rows] == states
    demo, big, later = rows
    assert demo.on_disk and demo.disk_bytes == 123 and demo.fits and "default" in demo.aliases
    assert not big.fits and big.aliases == ["huge"] and "70" in big.verdict  # a 70B model: over 16 GiB
    assert not later.on_disk and later.disk_bytes is None
    table = format_models(rows, 16 * GIB)
    assert "heavy: Ollama" in table and "not yet" in table and "memory budget for a model: 16.0 GiB" in table
    assert f"big: {big.verdict}" in table  # why it is heavy, said under the table


def test_the_command_as_a_table_and_as_json(tmp_path, demo_models):
    encoder = tmp_path / "encoder"
    encoder.mkdir()
    (encoder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")  # no tensors: 0 bytes
    (tmp_path / "mlxd.toml").write_text(dumps({"models": {"demo-a": {"path": str(demo_models.a)},
                                                          "big": {"path": str(demo_models.heavy)}},
                                               "embeddings": {"enc": {"path": str(encoder)},
                                                              "gone": {"path": str(tmp_path / "missing")}},
                                               "engine": {"port": 1}}))  # nothing listens there
    env = {**os.environ, "MLXD_HOME": str(tmp_path), "MLXD_MEMORY_TOTAL_BYTES": str(32 * GIB)}
    env.pop("MLXD_CONFIG", None)
    table = subprocess.run(MLXD + ["models"], env=env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split() == ["MODEL", "KIND", "ALIASES", "ON", "DISK", "ESTIMATE", "FITS",
                                                    "ENGINE", "SOURCE"]
    out = subprocess.run(MLXD + ["models", "--json"], env=env, capture_output=True, text=True, timeout=60)
    body = json.loads(out.stdout)
    rows = {r["id"]: r for r in body["models"]}
    assert set(rows) == {"demo-a", "big", "enc", "gone", "reranker"} and body["budget_bytes"] > 0
    assert [rows[m]["kind"] for m in ("demo-a", "enc")] == ["chat", "embedding"]
    assert rows["enc"]["on_disk"] and rows["enc"]["fits"] and not rows["gone"]["on_disk"]
    assert rows["demo-a"]["fits"] and rows["demo-a"]["disk_bytes"] == sum(
        f.stat().st_size for f in demo_models.a.iterdir() if f.is_file())
    assert not rows["big"]["fits"] and rows["big"]["state"] == "?"


@pytest.mark.parametrize("health, weights, state, fits", [
    (EngineHealth(status="ok", resident_model="demo-a", embedding_model="enc"), 90 * 2**20, "loaded", True),
    (EngineHealth(status="ok", resident_model="demo-a"), 90 * 2**20, "-", True),
    (None, 90 * 2**20, "?", True),
    (EngineHealth(status="ok"), 32 * GIB, "-", False),  # its weights alone over the budget
])
def test_an_embedding_models_row(tmp_path, health, weights, state, fits):
    from mlxd.model_list import embedding_rows

    config = parse_config({"models": {"demo-a": {"demo": "a"}}, "embeddings": {"enc": {"path": "/e"}}}, tmp_path)
    (row,) = embedding_rows(config, {"enc": weights}, {"enc": 1234}, 16 * GIB, health)
    assert (row.id, row.kind, row.state, row.fits, row.estimate_bytes, row.disk_bytes) == (
        "enc", "embedding", state, fits, weights, 1234)
    assert ("beside the chat model" in row.verdict) is fits


@pytest.mark.parametrize("health, states", [
    (None, {"cos": "?", "judge": "?", "ce": "?"}),
    (EngineHealth(status="ok", resident_model="demo-a", embedding_model="enc", reranker_model="ce"),
     {"cos": "loaded", "judge": "loaded", "ce": "loaded"}),
    (EngineHealth(status="ok", resident_model=None, embedding_model=None, reranker_model=None),
     {"cos": "-", "judge": "-", "ce": "-"}),
])
def test_rerankers_are_listed_with_what_they_use(tmp_path, health, states):
    """`mlxd models` lists rerankers as embedding models are: a cross-encoder by its own weights, one of
    embeddings or of a chat model by what it ranks with, none of its own; loaded as what it uses is."""
    from mlxd.config import parse_config
    from mlxd.model_list import reranker_rows

    config = parse_config({"models": {"demo-a": {"demo": "a"}}, "aliases": {"default": "demo-a"},
                           "embeddings": {"enc": {"path": str(tmp_path)}},
                           "rerankers": {"cos": {"embedding": "enc"}, "judge": {"chat_model": "default"},
                                         "ce": {"path": str(tmp_path)}}}, tmp_path)
    rows = {r.id: r for r in reranker_rows(config, {"ce": 90 * 2**20}, {"ce": 91 * 2**20}, 2**30, health)}
    assert {k: r.state for k, r in rows.items()} == states
    assert all(r.kind == "reranker" for r in rows.values())
    assert rows["ce"].estimate_bytes == 90 * 2**20 and rows["cos"].estimate_bytes == 0
    assert rows["judge"].source == "chat demo-a" and rows["cos"].source == "embedding enc"
