"""The gateway starts with no network at all: LiteLLM must not fetch its
cost map (or anything else) at import or startup. Proved by starting it in
an empty network namespace (loopback only)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = [
    pytest.mark.integration,  # starts processes
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs root and iproute2 to create a network namespace"),
]

PROBE = r"""
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=1) as r:
            print(r.status); sys.exit(0)
    except OSError:
        time.sleep(0.1)
print("timeout"); sys.exit(1)
"""


def test_gateway_starts_and_answers_with_no_network(tmp_path):
    ns = f"mlxd-offline-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    gateway = None
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        env = {**os.environ, "MLXD_HOME": str(tmp_path)}
        env.pop("LITELLM_LOCAL_MODEL_COST_MAP", None)  # the gateway must set it itself
        (tmp_path / "mlxd.toml").write_text("[gateway]\nport = 14123\n")
        t0 = time.monotonic()
        gateway = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "mlxd.cli", "gateway"], env=env,
                                   stdout=open(tmp_path / "gw.log", "wb"), stderr=subprocess.STDOUT)
        probe = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", PROBE,
                                "http://127.0.0.1:14123/mlxd/health", "90"], capture_output=True, text=True, timeout=120)
        assert probe.stdout.strip() == "200", (tmp_path / "gw.log").read_text()[-3000:]
        assert time.monotonic() - t0 < 60
        assert gateway.poll() is None
    finally:
        if gateway is not None:
            gateway.terminate()
            try:
                gateway.wait(20)
            except subprocess.TimeoutExpired:
                gateway.kill()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
