"""The LaunchAgent rendered from the config: keys, types, absolute paths, no secrets."""

import os
import plistlib
import re
import subprocess
from pathlib import Path

import pytest

from mlxd.config import parse_config
from mlxd.gateway.keys import ensure_key
from mlxd.launchd.common import default_path_env, mlxd_argv
from mlxd.supervisor.supervisord_conf import stop_timeout_s
from mlxd.launchd.plist import LABEL, plist_bytes, render_launch_agent
from mlxd.paths import StatePaths
from mlxd.supervisor.supervisord_conf import render_supervisord_conf

HOME = Path("/Users/someone/.mlxd")


def agent(config=None, extra_env=None) -> dict:
    config = config or parse_config({}, HOME)
    raw = plist_bytes(render_launch_agent(config, mlxd_argv(), default_path_env(), extra_env))
    assert raw.startswith(b"<?xml")
    return plistlib.loads(raw)


def stopwaitsecs(config) -> list[int]:
    return [int(s) for s in re.findall(r"^stopwaitsecs=(\d+)$", render_supervisord_conf(config), re.M)]


def test_keys_and_types():
    d = agent()
    assert d["Label"] == LABEL == "dev.mlxd.agent"
    assert d["ProgramArguments"][1:] == ["-m", "mlxd.cli", "up"]
    assert d["RunAtLoad"] is True
    assert d["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    assert d["KeepAlive"]["SuccessfulExit"] is False and d["KeepAlive"]["Crashed"] is True
    assert type(d["ThrottleInterval"]) is int and d["ThrottleInterval"] >= 5
    assert d["ProcessType"] == "Interactive"
    assert d["EnvironmentVariables"]["MLXD_HOME"] == str(HOME) == d["WorkingDirectory"]
    assert d["EnvironmentVariables"]["PATH"].split(":")[0] == os.path.dirname(d["ProgramArguments"][0])
    assert "/opt/homebrew/bin" in d["EnvironmentVariables"]["PATH"].split(":")
    assert d["StandardErrorPath"] == str(StatePaths(HOME).logs / "launchd.err")
    assert not d["StandardErrorPath"].endswith(("supervisord.log", "engine.log", "engine.err.log"))


@pytest.mark.parametrize("grace", [0.0, 10.0, 120.0])
def test_exit_timeout_outlasts_every_stop_timeout_of_supervisord(grace):
    config = parse_config({"engine": {"shutdown_grace_s": grace}}, HOME)
    d = agent(config)
    engine_stop_wait = int(grace) + 10  # supervisord_conf.py's engine stopwaitsecs
    assert engine_stop_wait in stopwaitsecs(config)
    assert type(d["ExitTimeOut"]) is int
    # supervisord stops its programs one after another: outlast them all together.
    assert d["ExitTimeOut"] > sum(stopwaitsecs(config)) > engine_stop_wait
    assert d["ExitTimeOut"] == stop_timeout_s(config)


def test_every_path_is_absolute():
    d = agent()
    env = d["EnvironmentVariables"]
    paths = [d["ProgramArguments"][0], d["WorkingDirectory"], d["StandardOutPath"], d["StandardErrorPath"],
             env["MLXD_HOME"], *env["PATH"].split(":")]
    assert all(os.path.isabs(p) for p in paths), paths


def test_the_program_is_this_venvs_mlxd():
    argv = agent()["ProgramArguments"]
    out = subprocess.run([*argv[:-1], "up", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--detach" in out.stdout


def test_relative_paths_are_refused():
    with pytest.raises(ValueError, match="absolute"):
        render_launch_agent(parse_config({}, HOME), ["python", "-m", "mlxd.cli"], default_path_env())
    with pytest.raises(ValueError, match="absolute"):
        render_launch_agent(parse_config({}, Path("rel/home")), mlxd_argv(), default_path_env())
    with pytest.raises(ValueError, match="absolute"):
        render_launch_agent(parse_config({}, HOME), mlxd_argv(), "bin:/usr/bin")


def test_no_key_material(tmp_path):
    home = tmp_path / "home"
    key = ensure_key(StatePaths(home))
    config = parse_config({}, home)
    raw = plist_bytes(render_launch_agent(config, mlxd_argv(), default_path_env()))
    assert key.encode() not in raw and b"sk-mlxd-" not in raw
    assert not [k for k in plistlib.loads(raw)["EnvironmentVariables"] if re.search("KEY|TOKEN|SECRET", k)]
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        render_launch_agent(config, mlxd_argv(), default_path_env(), {"OPENAI_API_KEY": key})


def test_config_overrides_are_carried():
    env = agent(extra_env={"MLXD_ENGINE_PORT": "9999", "MLXD_CONFIG": "/etc/mlxd.toml"})["EnvironmentVariables"]
    assert env["MLXD_ENGINE_PORT"] == "9999" and env["MLXD_CONFIG"] == "/etc/mlxd.toml"
    with pytest.raises(ValueError, match="MLXD_CONFIG"):
        agent(extra_env={"MLXD_CONFIG": "mlxd.toml"})
