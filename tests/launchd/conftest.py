"""Recording stand-ins for launchctl and systemctl (test doubles), put first
on PATH, and a temp HOME with the override directories, so no test touches
the real user's service manager or files."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxd.config import Config, parse_config

STANDIN = f"""#!{sys.executable}
# TEST DOUBLE for launchctl/systemctl, written by tests/launchd/conftest.py:
# appends its argv to calls.jsonl, then answers from <name>.json, which maps
# a verb (the first argument not starting with "-") to a list of answers
# [exit status, stdout, stderr, seconds to sleep first], used in turn; the
# last one repeats. No answer given: exit 0, no output.
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
name = os.path.basename(__file__)
args = sys.argv[1:]
with open(os.path.join(here, "calls.jsonl"), "a") as f:
    f.write(json.dumps([name, *args]) + "\\n")
verb = next((a for a in args if not a.startswith("-")), "")
try:
    with open(os.path.join(here, name + ".json")) as f:
        answers = json.load(f).get(verb, [])
except FileNotFoundError:
    answers = []
counter = os.path.join(here, f".{{name}}.{{verb}}.n")
n = int(open(counter).read()) if os.path.exists(counter) else 0
with open(counter, "w") as f:
    f.write(str(n + 1))
answer = list(answers[min(n, len(answers) - 1)]) if answers else []
rc, out, err, pause = answer + [0, "", "", 0][len(answer):]
time.sleep(pause)
sys.stdout.write(out)
sys.stderr.write(err)
sys.exit(rc)
"""


@dataclass
class Tools:
    bin: Path
    home: Path  # MLXD_HOME
    agents: Path  # MLXD_LAUNCH_AGENTS_DIR
    units: Path  # MLXD_SYSTEMD_USER_DIR
    config: Config

    def answer(self, tool: str, **verbs: list) -> None:
        """Script the answers of `tool` per verb: answer("launchctl", bootstrap=[[5, "", "..."], [0]])."""
        (self.bin / f"{tool}.json").write_text(json.dumps(verbs))

    def calls(self) -> list[list[str]]:
        log = self.bin / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tools:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("launchctl", "systemctl"):
        script = bindir / name
        script.write_text(STANDIN)
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    user_home = tmp_path / "user"
    user_home.mkdir()
    monkeypatch.setenv("HOME", str(user_home))
    monkeypatch.setenv("MLXD_LAUNCH_AGENTS_DIR", str(tmp_path / "LaunchAgents"))
    monkeypatch.setenv("MLXD_SYSTEMD_USER_DIR", str(tmp_path / "systemd-user"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    for name in ("MLXD_CONFIG", "MLXD_ENGINE_HOST", "MLXD_ENGINE_PORT", "MLXD_GATEWAY_HOST",
                 "MLXD_GATEWAY_PORT", "MLXD_OLLAMA_URL", "MLXD_FAULT"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "mlxd home"  # a space: paths must survive it
    monkeypatch.setenv("MLXD_HOME", str(home))
    return Tools(bindir, home, tmp_path / "LaunchAgents", tmp_path / "systemd-user", parse_config({}, home))
