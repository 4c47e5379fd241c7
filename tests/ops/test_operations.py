"""The mlxd command end to end in a temp home: up, status (table, JSON and
exit codes against reality), restart, logs, doctor, the scripts, down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from mlxd.devkit.stack import Stack, stack_env
from testkit import free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]  # starts processes
REPO = Path(__file__).resolve().parents[2]


def test_status_json_matches_reality_and_shows_a_crash(stack):
    st = stack()
    r = st.mlxd("status", "--json")
    assert r.returncode == 0
    status = json.loads(r.stdout)
    procs = {p["name"]: p for p in status["processes"]}
    engine_rec = json.loads(st.paths.engine_pid.read_text())
    assert procs["engine"]["state"] == "RUNNING" and procs["engine"]["pid"] == engine_rec["runner_pid"]
    health = status["engine"]["health"]
    assert health["pid"] == engine_rec["pid"] and health["resident_model"] == "demo-a"
    assert health["memory"]["mlx_active_bytes"] > 10_000_000
    assert status["supervision"]["mode"] == "running" and status["crashes"]["last"] is None
    table = st.mlxd("status").stdout
    assert "healthy" in table and "demo-a" in table and "crashes       0 last hour" in table

    os.kill(engine_rec["pid"], signal.SIGABRT)
    wait_until(lambda: st.records(), 30, what="crash journaled")
    wait_until(st.healthy, 60, what="engine back")
    status = st.status()
    assert status["crashes"]["last"]["class"] == "sigabrt" and status["crashes"]["last_hour"] == 1
    assert status["engine"]["health"]["pid"] != engine_rec["pid"]
    assert "last: sigabrt" in st.mlxd("status").stdout


def test_status_exit_codes_degraded_then_down(stack):
    st = stack(supervisor="loop_crashes = 2\ncooldown_s = 600", fault="abort@boot")
    wait_until(lambda: st.supervision().get("mode") == "degraded", 60, what="degraded")
    r = st.mlxd("status")
    assert r.returncode == 1 and "degraded" in r.stdout
    assert st.mlxd("down").returncode == 0
    r = st.mlxd("status", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["overall"] == "down"


def test_scripts_work_from_another_directory_with_a_clean_environment(stack, tmp_path):
    st = stack()
    clean = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "MLXD_HOME": str(st.home)}
    r = subprocess.run(["bash", str(REPO / "scripts" / "status.sh"), "--json"], cwd=tmp_path, env=clean,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    before = json.loads(r.stdout)["engine"]["health"]["pid"]
    r = subprocess.run(["bash", str(REPO / "scripts" / "restart.sh"), "engine"], cwd=tmp_path, env=clean,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert st.status()["engine"]["health"]["pid"] != before
    r = subprocess.run(["bash", str(REPO / "scripts" / "logs.sh"), "engine", "-n", "50"], cwd=tmp_path, env=clean,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "loaded demo-a" in r.stdout
    st.mlxd("down")
    r = subprocess.run(["bash", str(REPO / "scripts" / "status.sh")], cwd=tmp_path, env=clean,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "down" in r.stdout


def test_doctor_reports_each_check_with_a_verdict(stack):
    st = stack()
    r = st.mlxd("doctor", "--json")
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert {"python", "packages", "mlx backend", "engine port", "config", "ollama"} <= set(checks)
    assert checks["engine port"]["status"] == "pass"  # in use, but by mlxd itself
    assert checks["model demo-a"]["status"] == "pass"
    assert all(c["status"] in ("pass", "warn", "fail") for c in checks.values())
    assert r.returncode == (69 if any(c["status"] == "fail" for c in checks.values()) else 0)  # EX_UNAVAILABLE


def test_first_up_writes_a_default_config_and_a_key(tmp_path):
    st = Stack(tmp_path, stack_env(tmp_path, extra={"MLXD_ENGINE_PORT": str(free_port()),
                                                    "MLXD_GATEWAY_PORT": str(free_port())}))
    try:
        r = st.mlxd("up", "--detach", "--timeout", "180", timeout=240)
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "mlxd.toml").exists() and "every alias serves" in r.stderr
        assert "Authorization: Bearer" in r.stdout and str(st.paths.key) in r.stdout
        assert "stop: mlxd down" in r.stdout and "Ctrl-C" not in r.stdout  # detached: no Ctrl-C stops it
        assert os.stat(st.paths.key).st_mode & 0o777 == 0o600
    finally:
        st.stop()


def test_a_foreign_listener_on_our_port_is_reported_not_killed(tmp_path):
    import socket
    import sys

    port = free_port()
    squatter = subprocess.Popen([sys.executable, "-c", f"""
import socket, time
s = socket.socket(); s.bind(("127.0.0.1", {port})); s.listen(); time.sleep(120)
"""])
    try:
        def listening() -> bool:
            with socket.socket() as c:
                return c.connect_ex(("127.0.0.1", port)) == 0
        wait_until(listening, 30, what="squatter listening")
        env = {**os.environ, "MLXD_HOME": str(tmp_path), "MLXD_ENGINE_PORT": str(port)}
        r = subprocess.run([sys.executable, "-m", "mlxd.cli", "status", "--json"], env=env, capture_output=True,
                           text=True, timeout=60)
        found = json.loads(r.stdout)["foreign_listeners"]
        assert any(f["pid"] == squatter.pid and f["port"] == port for f in found)
        assert squatter.poll() is None  # reported, not killed
    finally:
        squatter.kill()
        squatter.wait()
