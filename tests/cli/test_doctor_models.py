"""`mlxd doctor` fails a configured model whose files are missing, with the
fix, by the same check as `mlxd config validate` and `mlxd up`
(cli/preflight.py's problems_of_model; its folder table is in
tests/cli/test_first_run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.cli.doctor import Check, check_config, files_check
from mlxd.cli.preflight import FolderFacts, Problem, folder_problem

MLXD = [sys.executable, "-m", "mlxd.cli"]
FOLDER = Path("/models/m")
MISSING = FolderFacts(is_dir=False, has_config=False, has_weights=False)
EMPTY = FolderFacts(is_dir=True, has_config=False, has_weights=False)
NO_WEIGHTS = FolderFacts(is_dir=True, has_config=True, has_weights=False)
MODEL = FolderFacts(is_dir=True, has_config=True, has_weights=True)


@pytest.mark.parametrize("facts, too_large, says", [
    (MISSING, False, "/models/m does not exist"),
    (MISSING, True, "/models/m does not exist"),
    (EMPTY, False, "has no config.json"),
    (EMPTY, True, "has no config.json"),  # too large or not, config.json is what tells
    (NO_WEIGHTS, False, "has config.json but no *.safetensors weights"),
    (NO_WEIGHTS, True, None),  # never loaded here (Ollama serves it): its weights are not needed
    (MODEL, False, None),
    (MODEL, True, None),
])
def test_folder_problem(facts, too_large, says):
    problem = folder_problem("m", FOLDER, facts, too_large)
    if says is None:
        assert problem is None
    else:
        assert problem.what.startswith(f"models.m.path: {FOLDER} ") and says in problem.what
        assert "[models.m] path" in problem.fix


CONFIG_FILE = Path("/home/u/.mlxd/mlxd.toml")
GONE = Problem("models.m.path: /x does not exist", "point [models.m] path at an MLX model folder")


@pytest.mark.parametrize("problems, expected", [
    ([], None),
    ([GONE], Check("model m", "fail", "models.m.path: /x does not exist",
                   "edit /home/u/.mlxd/mlxd.toml: point [models.m] path at an MLX model folder -- or remove "
                   "[models.m] (and its aliases); then `mlxd config validate`")),
])
def test_files_check(problems, expected):
    assert files_check("m", problems, CONFIG_FILE) == expected


@pytest.mark.parametrize("problems, status", [
    ({}, "pass"),
    ({"a": [], "b": []}, "pass"),
    ({"a": [], "b": [GONE]}, "fail"),
])
def test_the_config_check_agrees_with_config_validate(problems, status):
    check = check_config(CONFIG_FILE, problems)
    assert check.status == status
    assert ("model(s) b" in check.detail) == (status == "fail")


@pytest.mark.integration  # runs the mlxd command
def test_doctor_fails_a_model_path_that_does_not_exist_and_says_the_fix(tmp_path):
    config_file = tmp_path / "mlxd.toml"
    config_file.write_text('[models.mine]\npath = "/does/not/exist"\n\n[aliases]\ndefault = "mine"\n')
    env = {**os.environ, "MLXD_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env.pop("MLXD_CONFIG", None)
    r = subprocess.run([*MLXD, "doctor"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 69, r.stdout + r.stderr  # EX_UNAVAILABLE: a check failed
    line = next(line for line in r.stdout.splitlines() if "model mine" in line)
    assert line.startswith("FAIL") and "models.mine.path: /does/not/exist does not exist" in line
    assert f"fix: edit {config_file}: point [models.mine] path at an MLX model folder" in r.stdout
    assert "or remove [models.mine]" in r.stdout and "Traceback" not in r.stderr
    validate = subprocess.run([*MLXD, "config", "validate"], env=env, capture_output=True, text=True, timeout=60)
    assert validate.returncode == 78 and "models.mine.path: /does/not/exist does not exist" in validate.stderr
    checks = {c["name"]: c for c in json.loads(subprocess.run([*MLXD, "doctor", "--json"], env=env,
                                                              capture_output=True, text=True, timeout=120).stdout)}
    assert checks["model mine"]["status"] == "fail" and checks["config"]["status"] == "fail"
