"""The systemd user unit rendered from the config."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mlxd.config import parse_config
from mlxd.launchd.common import default_path_env, mlxd_argv
from mlxd.supervisor.supervisord_conf import stop_timeout_s
from mlxd.launchd.systemd import render_systemd_unit

HOME = Path("/home/someone/.mlxd")


def sections(text: str) -> dict[str, list[str]]:
    """[Section] -> its non-comment lines, in order."""
    out: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if not line.strip() or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            out[current] = []
        else:
            out[current].append(line)
    return out


def test_the_unit_has_the_right_lines():
    config = parse_config({}, HOME)
    py = mlxd_argv()[0]
    s = sections(render_systemd_unit(config, mlxd_argv(), default_path_env()))
    assert list(s) == ["Unit", "Service", "Install"]
    assert {"StartLimitIntervalSec=300", "StartLimitBurst=5"} <= set(s["Unit"])
    service = set(s["Service"])
    assert {"Type=simple", f"ExecStart={py} -m mlxd.cli up", f"ExecStop={py} -m mlxd.cli down",
            "Restart=on-failure", "RestartSec=5", "KillMode=mixed", f"WorkingDirectory={HOME}",
            f'Environment="MLXD_HOME={HOME}"', f'Environment="PATH={default_path_env()}"'} <= service
    assert s["Install"] == ["WantedBy=default.target"]
    stop = [int(line.split("=")[1]) for line in service if line.startswith("TimeoutStopSec=")]
    assert stop == [stop_timeout_s(config)] and stop[0] > config.engine.shutdown_grace_s + 10
    assert not [line for line in service if re.match(r"Environment=.*(KEY|TOKEN|SECRET)", line)]


def test_specifiers_and_spaces_are_escaped():
    unit = render_systemd_unit(parse_config({}, Path("/tmp/a b%c")), ["/opt/my py/python", "-m", "mlxd.cli"],
                               default_path_env())
    assert 'ExecStart="/opt/my py/python" -m mlxd.cli up' in unit
    assert 'Environment="MLXD_HOME=/tmp/a b%%c"' in unit and "WorkingDirectory=/tmp/a b%%c" in unit


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not on PATH")
def test_systemd_analyze_verify_accepts_it(tmp_path):
    home = tmp_path / "odd home%"
    unit = tmp_path / "mlxd.service"
    unit.write_text(render_systemd_unit(parse_config({}, home), mlxd_argv(), default_path_env()))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # verify reports a bad line but still exits 0 ("..., ignoring"): read what it says, too.
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if "mlxd.service" in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr
