"""Every `mlxd` command given bad input says what is wrong in one line,
exits with a documented code (docs/OPERATIONS.md: 64 a bad command line, 66
not there, 75 a transfer failed) and never prints a traceback (issue 52, item 5)."""

from __future__ import annotations

import subprocess

import pytest

from mlxd.devkit.engine_process import MLXD, mlxd_env

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("args, code, says", [
    ([], 64, "required: COMMAND"),
    (["status", "--bogus"], 64, "unrecognized arguments"),
    (["bogus"], 64, "invalid choice"),
    (["key", "rotate", "bogus"], 64, "invalid choice"),
    (["key", "show", "engine"], 64, "internal"),
    (["logs", "bogus"], 64, "invalid choice"),
    (["pull", ""], 64, "repo id"),
    (["pull", "../x"], 64, "repo id"),
    (["pull", "a/b/c"], 64, "repo id"),
    (["rm", "../x"], 64, "repo id"),
    (["rm", "org/nothing-here"], 66, "not in the Hugging Face cache"),
    (["pull", "org/nothing-here"], 75, "offline"),
    (["rm"], 64, "required: name"),
    (["models", "--bogus"], 64, "unrecognized arguments"),
])
def test_bad_input_gets_one_clear_line_and_a_documented_code(tmp_path, args, code, says):
    done = subprocess.run([*MLXD, *args], env=mlxd_env(tmp_path, {"HF_HOME": str(tmp_path / "hf")}),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr and says in done.stderr, done.stderr
    said = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("usage:", "  "))]
    assert len(said) == 1, done.stderr  # the reason, once (argparse's usage line before it aside)
