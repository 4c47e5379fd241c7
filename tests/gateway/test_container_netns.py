"""The Docker case, without Docker: a client in its own network namespace
(a stand-in for a container, made with `ip netns` and a veth pair) reaches
the gateway through the veth address with the key, is refused without it,
and cannot reach the engine's port at all (the engine binds loopback only)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs root and iproute2 to create a network namespace"),
]

CLIENT = r"""
import json, sys, urllib.request, urllib.error
url, key, engine = sys.argv[1], sys.argv[2], sys.argv[3]
def post(u, headers):
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
    req = urllib.request.Request(u, data=body, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return type(e).__name__
print(json.dumps({"with_key": post(url, {"Authorization": "Bearer " + key}), "without_key": post(url, {}),
                  "engine": post(engine, {})}))
"""


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def container_netns():
    """A namespace with a veth link to the host: (name, host address)."""
    n = random.randrange(1, 250)
    ns, host_if, ns_if = f"mlxd-test-{os.getpid()}-{n}", f"mxh{os.getpid() % 10000}{n}", f"mxc{os.getpid() % 10000}{n}"
    host_ip, ns_ip = f"10.213.{n}.1", f"10.213.{n}.2"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_a_container_reaches_the_gateway_with_the_key_and_never_the_engine(stack, container_netns):
    ns, host_ip = container_netns
    st = stack(gateway='host = "0.0.0.0"')  # the documented choice for Docker runtimes other than Docker Desktop
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT,
         f"http://{host_ip}:{st.config.gateway.port}/v1/chat/completions", st.key,
         f"http://{host_ip}:{st.config.engine.port}/v1/chat/completions"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["with_key"] == 200
    assert seen["without_key"] == 401
    assert seen["engine"] in ("ConnectionRefusedError", "URLError")  # bound to 127.0.0.1 only
