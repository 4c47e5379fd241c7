"""What `mlxd up` started with is remembered in $MLXD_HOME: `status`,
`logs`, `restart`, `down` and the scripts, run later without the MLXD_*
variables `up` was given, reach the same stack; a variable set now wins;
`down` forgets it. A real stack on free ports, stopped by pid at the end."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from mlxd.devkit.stack import MLXD, Stack, stack_env
from mlxd.paths import StatePaths
from mlxd.records import StartedWith
from mlxd.supervisor.control import kill_all, supervisord_pid
from mlxd.toml_text import dumps
from testkit import free_port, wait_until

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
TEST_SETTINGS = ("[engine]\nstuck_grace_s = 1.0\n\n[supervisor]\nbackoff_base_s = 0.2\n"
                 "health_interval_s = 0.25\nstart_grace_s = 20\n")


def write_configs(home: Path, elsewhere: Path, model: Path) -> Path:
    """The home's own mlxd.toml has no gateway; the file `up` is pointed
    at elsewhere has one, so a command that reads the wrong file shows it."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "mlxd.toml").write_text("[gateway]\nenabled = false\n")
    elsewhere.mkdir(parents=True, exist_ok=True)
    custom = elsewhere / "custom.toml"
    custom.write_text(TEST_SETTINGS + "\n" + dumps({"models": {"demo-a": {"path": model}},
                                                  "aliases": {"default": "demo-a"}}))
    return custom


def test_status_logs_restart_and_down_reach_the_stack_without_the_variables(tmp_path, demo_models):
    home = tmp_path / "home"
    custom = write_configs(home, tmp_path / "elsewhere", demo_models.a)
    given = {"MLXD_CONFIG": str(custom), "MLXD_ENGINE_PORT": str(free_port()),
             "MLXD_GATEWAY_PORT": str(free_port()), "MLXD_OLLAMA_URL": f"http://127.0.0.1:{free_port()}"}
    started = Stack(home, stack_env(home, extra=given))
    bare = Stack(home, stack_env(home))  # the same home, none of the variables
    paths = StatePaths(home)
    try:
        started.up(120)
        record = StartedWith.read(paths.started_with)
        assert record is not None and record.env == given and record.engine_port == int(given["MLXD_ENGINE_PORT"])

        r = bare.mlxd("status", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        st = json.loads(r.stdout)
        assert st["overall"] == "healthy" and st["engine"]["health"]["resident_model"] == "demo-a"
        assert f":{given['MLXD_ENGINE_PORT']}/" in st["engine"]["url"]
        assert st["gateway"]["http_status"] == 200 and f":{given['MLXD_GATEWAY_PORT']}/" in st["gateway"]["url"]
        assert st["ollama"]["url"] == given["MLXD_OLLAMA_URL"] and st["started_with"]["env"] == given
        table = bare.mlxd("status").stdout
        assert f"MLXD_GATEWAY_PORT={given['MLXD_GATEWAY_PORT']}" in table and "healthy" in table

        doctor = json.loads(bare.mlxd("doctor", "--json").stdout)  # the ports it runs on, not the defaults
        ports = {c["name"]: c["detail"] for c in doctor if c["name"].endswith(" port")}
        assert ports["engine port"].startswith(f"127.0.0.1:{given['MLXD_ENGINE_PORT']} in use"), ports
        assert ports["gateway port"].startswith(f"127.0.0.1:{given['MLXD_GATEWAY_PORT']} in use"), ports
        models = json.loads(bare.mlxd("models", "--json").stdout)["models"]
        assert [m["state"] for m in models if m["id"] == "demo-a"] == ["loaded"], models  # read from the engine

        other_port = str(free_port())  # a variable set now wins over what `up` started with
        r = subprocess.run([*MLXD, "status", "--json"], env={**bare.env, "MLXD_GATEWAY_PORT": other_port},
                           capture_output=True, text=True, timeout=60)
        assert f":{other_port}/" in json.loads(r.stdout)["gateway"]["url"]

        again = bare.mlxd("up", "--detach")  # already running: what it started with stays
        assert again.returncode == 0 and "already running" in again.stdout
        assert StartedWith.read(paths.started_with) == record

        clean = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "MLXD_HOME": str(home)}
        r = subprocess.run(["bash", str(REPO / "scripts" / "status.sh"), "--json"], cwd=tmp_path, env=clean,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and json.loads(r.stdout)["overall"] == "healthy", r.stdout + r.stderr
        before = st["engine"]["health"]["pid"]
        r = subprocess.run(["bash", str(REPO / "scripts" / "restart.sh"), "engine"], cwd=tmp_path, env=clean,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr  # it waited for the engine on the remembered port
        assert started.status()["engine"]["health"]["pid"] != before
        r = subprocess.run(["bash", str(REPO / "scripts" / "logs.sh"), "engine", "-n", "80"], cwd=tmp_path,
                           env=clean, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "loaded demo-a" in r.stdout

        r = bare.mlxd("restart", "all", timeout=300)  # started again as `up` was: same file, same ports
        assert r.returncode == 0, r.stderr
        assert started.ready() and StartedWith.read(paths.started_with).env == given

        r = bare.mlxd("down", timeout=120)
        assert r.returncode == 0 and "mlxd stopped" in r.stdout
        assert supervisord_pid(paths) is None and not started.healthy()
        assert not paths.started_with.exists()  # nothing runs: nothing to remember
        r = bare.mlxd("status", "--json")  # now from the home's own mlxd.toml: down, and truthfully so
        assert r.returncode == 2 and json.loads(r.stdout)["overall"] == "down"
    finally:
        kill_all(paths)


def test_a_foreground_up_forgets_when_its_stack_stops(tmp_path, demo_models):
    home = tmp_path / "home"
    custom = write_configs(home, tmp_path / "elsewhere", demo_models.a)
    given = {"MLXD_CONFIG": str(custom), "MLXD_ENGINE_PORT": str(free_port()), "MLXD_GATEWAY_PORT": str(free_port())}
    started = Stack(home, stack_env(home, extra=given))
    paths = StatePaths(home)
    up = subprocess.Popen([*MLXD, "up"], env=started.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(started.ready, 120, interval=0.25, what="the stack ready")
        assert StartedWith.read(paths.started_with).up_pid == up.pid
        up.send_signal(signal.SIGINT)  # Ctrl-C
        up.wait(120)
        assert not paths.started_with.exists()
    finally:
        if up.poll() is None:
            up.kill()
        kill_all(paths)
