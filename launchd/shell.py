"""The shell under install/uninstall/status: run one launchctl/systemctl
command (found on PATH by name, output captured, time-bounded), and gather
what a unit is rendered from."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mlxd.config import Config
from mlxd.paths import write_atomic

from .common import PASSTHROUGH_ENV, default_path_env, mlxd_argv

MISSING = {"launchctl": "launchd exists only on macOS",
           "systemctl": "systemd user services need Linux with systemd"}


class ServiceError(RuntimeError):
    """A service tool is missing, failed or did not answer; the message says which."""


def require_tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise ServiceError(f"{name} not found: {MISSING.get(name, 'not on PATH')}")
    return exe


def run_tool(argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run one command, its program looked up on PATH by name."""
    exe = require_tool(argv[0])
    try:
        return subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ServiceError(f"`{' '.join(argv)}` did not answer within {timeout:.0f}s") from None
    except OSError as exc:
        raise ServiceError(f"cannot run {exe}: {exc}") from None


def message(r: subprocess.CompletedProcess) -> str:
    """A command's complaint on one line."""
    return (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}").replace("\n", " | ")


@dataclass(frozen=True)
class Inputs:
    """What a unit is rendered from; every path absolute."""

    config: Config
    argv: list[str]
    path_env: str
    extra_env: dict[str, str]


def render_inputs(config: Config, config_file: Path | None = None) -> Inputs:
    """This venv's mlxd, its PATH, and the config overrides set now (--config
    or MLXD_CONFIG become an absolute MLXD_CONFIG)."""
    config = config.model_copy(update={"home": Path(os.path.abspath(config.home.expanduser()))})
    extra = {k: os.environ[k] for k in PASSTHROUGH_ENV if os.environ.get(k)}
    if config_file is not None:
        extra["MLXD_CONFIG"] = str(config_file)
    if "MLXD_CONFIG" in extra:
        extra["MLXD_CONFIG"] = os.path.abspath(os.path.expanduser(extra["MLXD_CONFIG"]))
    return Inputs(config, mlxd_argv(), default_path_env(), extra)


def write_unit(path: Path, data: bytes, inputs: Inputs) -> None:
    """Atomically; first the state dirs, since WorkingDirectory and the log
    directory must exist before the service manager starts it."""
    inputs.config.paths.make_dirs()
    write_atomic(path, data)


def same_content(path: Path, data: bytes) -> bool | None:
    try:
        return path.read_bytes() == data
    except OSError:
        return None


def describe(kind: str, installed: bool, loaded: bool | None, facts: str, loaded_word: str = "loaded") -> str:
    """One self-contained line for `mlxd status` (which shows only this)."""
    if loaded is None:
        return f"{'installed' if installed else 'not installed'}, state unknown: {facts}"
    if installed and loaded:
        return f"installed, {loaded_word}: {facts}"
    if installed:
        return f"installed but not {loaded_word} ({facts}); `mlxd {kind} install` again to fix"
    if loaded:
        return f"{loaded_word}, but its file is gone ({facts}); `mlxd {kind} uninstall` to clean up"
    return f"not installed (`mlxd {kind} install` runs mlxd at login)"
