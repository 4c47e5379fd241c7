"""install / uninstall / status against recording stand-ins for launchctl and
systemctl (conftest.py): the right calls, in the right order, and the files."""

import os
import plistlib
import time
from argparse import Namespace

from mlxd.launchd.plist import LABEL
from mlxd.launchd.service import run_command, status_summary

UID = os.getuid()
TARGET = f"gui/{UID}/{LABEL}"
PRINT_RUNNING = f"""{TARGET} = {{
\tactive count = 1
\tpath = /Users/someone/Library/LaunchAgents/{LABEL}.plist
\tstate = running
\tprogram = /Users/someone/mlxd/.venv/bin/python
\tpid = 4242
\tlast exit code = (never exited)
}}
"""
NOT_FOUND = [113, "", f'Could not find service "{LABEL}" in domain for user gui: {UID}\n']
EIO = [5, "", "Bootstrap failed: 5: Input/output error\nTry re-running the command as root for richer errors.\n"]


def launchd(tools, action, **extra):
    return run_command(Namespace(platform="launchd", action=action, **extra), tools.config)


def systemd(tools, action):
    return run_command(Namespace(platform="systemd", action=action), tools.config)


def test_launchd_install_enables_then_bootstraps_the_written_plist(tools):
    plist = tools.agents / f"{LABEL}.plist"
    assert launchd(tools, "install") == 0
    assert tools.calls() == [["launchctl", "enable", TARGET], ["launchctl", "bootstrap", f"gui/{UID}", str(plist)]]
    d = plistlib.loads(plist.read_bytes())
    assert d["Label"] == LABEL and d["EnvironmentVariables"]["MLXD_HOME"] == str(tools.home)
    assert (tools.home / "logs").is_dir()  # launchd does not create the log's directory itself
    assert not list(tools.agents.glob(".*.tmp"))  # written atomically, no leftovers


def test_launchd_reinstall_boots_out_waits_for_the_old_job_then_bootstraps_again(tools):
    tools.answer("launchctl", bootstrap=[EIO, [0]], print=[[0, PRINT_RUNNING], NOT_FOUND])
    plist = tools.agents / f"{LABEL}.plist"
    assert launchd(tools, "install") == 0
    assert tools.calls() == [
        ["launchctl", "enable", TARGET],
        ["launchctl", "bootstrap", f"gui/{UID}", str(plist)],
        ["launchctl", "bootout", TARGET],
        ["launchctl", "print", TARGET],  # still draining...
        ["launchctl", "print", TARGET],  # ...gone
        ["launchctl", "bootstrap", f"gui/{UID}", str(plist)],
    ]


def test_launchd_bootstrap_failing_twice_is_an_error_with_a_hint(tools, capsys):
    tools.answer("launchctl", bootstrap=[EIO], print=[NOT_FOUND])
    assert launchd(tools, "install") == 1
    err = capsys.readouterr().err
    assert "Input/output error" in err and "GUI login session" in err
    verbs = [c[1] for c in tools.calls()]
    assert verbs == ["enable", "bootstrap", "bootout", "print", "bootstrap"]  # one retry, not a loop


def test_launchd_other_bootstrap_failures_are_not_retried(tools, capsys):
    tools.answer("launchctl", bootstrap=[[119, "", "Bootstrap failed: 119: Service is disabled\n"]])
    assert launchd(tools, "install") == 1
    assert "Service is disabled" in capsys.readouterr().err
    assert [c[1] for c in tools.calls()] == ["enable", "bootstrap"]


def test_launchd_uninstall_boots_out_then_removes_and_tolerates_not_loaded(tools):
    plist = tools.agents / f"{LABEL}.plist"
    assert launchd(tools, "install") == 0
    tools.answer("launchctl", bootout=[[3, "", "Boot-out failed: 3: No such process\n"]])
    assert launchd(tools, "uninstall") == 0
    assert tools.calls()[-1] == ["launchctl", "bootout", TARGET]
    assert not plist.exists()


def test_launchd_uninstall_keeps_the_plist_when_bootout_fails(tools, capsys):
    plist = tools.agents / f"{LABEL}.plist"
    assert launchd(tools, "install") == 0
    tools.answer("launchctl", bootout=[[1, "", "Boot-out failed: 1: Operation not permitted\n"]])
    assert launchd(tools, "uninstall") == 1
    assert plist.exists() and "Operation not permitted" in capsys.readouterr().err


def test_launchd_status_loaded_running_and_not_loaded(tools, capsys):
    assert launchd(tools, "install") == 0
    tools.answer("launchctl", print=[[0, PRINT_RUNNING], NOT_FOUND])
    s = status_summary(tools.config, platform="darwin")
    assert (s["kind"], s["installed"], s["loaded"], s["running"], s["pid"]) == ("launchd", True, True, True, 4242)
    assert s["current"] is True and "state = running" in s["detail"]
    assert tools.calls()[-1] == ["launchctl", "print", TARGET]
    capsys.readouterr()
    assert launchd(tools, "status") == 1  # installed, but (second answer) not loaded
    assert "installed but not loaded" in capsys.readouterr().out
    s = status_summary(tools.config, platform="darwin")
    assert (s["installed"], s["loaded"], s["pid"]) == (True, False, None)


def test_status_notices_a_plist_from_another_config(tools):
    assert launchd(tools, "install") == 0
    other = tools.config.model_copy(update={"engine": tools.config.engine.model_copy(update={"shutdown_grace_s": 99})})
    assert status_summary(other, platform="darwin")["current"] is False


def test_install_carries_config_overrides_but_nothing_else(tools, monkeypatch):
    monkeypatch.setenv("MLXD_ENGINE_PORT", "9999")
    monkeypatch.setenv("MLXD_FAULT", "abort@boot")
    assert launchd(tools, "install", config=tools.home / "custom.toml") == 0
    env = plistlib.loads((tools.agents / f"{LABEL}.plist").read_bytes())["EnvironmentVariables"]
    assert env["MLXD_ENGINE_PORT"] == "9999" and env["MLXD_CONFIG"] == str(tools.home / "custom.toml")
    assert "MLXD_FAULT" not in env


def test_a_missing_tool_is_a_clear_error_and_writes_nothing(tools, monkeypatch, capsys, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert launchd(tools, "install") == 1
    assert "launchctl not found: launchd exists only on macOS" in capsys.readouterr().err
    assert not tools.agents.exists()
    assert systemd(tools, "install") == 1
    assert "systemctl not found" in capsys.readouterr().err
    s = status_summary(tools.config, platform="darwin")
    assert s["loaded"] is None and "launchctl not found" in s["detail"]


def test_status_summary_is_quick_and_never_raises_when_the_tool_hangs(tools):
    tools.answer("launchctl", print=[[0, "", "", 30]])
    tools.answer("systemctl", **{"is-active": [[0, "active\n", "", 30]]})
    for platform in ("darwin", "linux"):
        t0 = time.monotonic()
        s = status_summary(tools.config, platform=platform)
        assert time.monotonic() - t0 < 6
        assert s["loaded"] is None and "did not answer" in s["detail"]


def test_systemd_install_writes_reloads_and_enables_now(tools):
    unit = tools.units / "mlxd.service"
    tools.answer("systemctl", **{"is-active": [[3, "inactive\n"]]})
    assert systemd(tools, "install") == 0
    assert tools.calls() == [["systemctl", "--user", "is-active", "mlxd.service"],
                             ["systemctl", "--user", "daemon-reload"],
                             ["systemctl", "--user", "enable", "--now", "mlxd.service"]]
    assert f'Environment="MLXD_HOME={tools.home}"' in unit.read_text()


def test_systemd_reinstall_restarts_the_running_unit(tools):
    tools.answer("systemctl", **{"is-active": [[0, "active\n"]]})
    assert systemd(tools, "install") == 0
    assert [c[2:] for c in tools.calls()][-2:] == [["enable", "--now", "mlxd.service"], ["restart", "mlxd.service"]]


def test_systemd_uninstall_disables_removes_and_reloads(tools):
    unit = tools.units / "mlxd.service"
    assert systemd(tools, "install") == 0
    n = len(tools.calls())
    tools.answer("systemctl", disable=[[1, "", "Failed to disable unit: Unit file mlxd.service does not exist.\n"]])
    assert systemd(tools, "uninstall") == 0
    assert tools.calls()[n:] == [["systemctl", "--user", "disable", "--now", "mlxd.service"],
                                 ["systemctl", "--user", "daemon-reload"]]
    assert not unit.exists()


def test_systemd_status(tools, capsys):
    tools.answer("systemctl", **{"is-active": [[3, "inactive\n"], [0, "active\n"], [3, "failed\n"]],
                                 "is-enabled": [[0, "enabled\n"], [1, "disabled\n"]]})
    assert systemd(tools, "install") == 0  # uses the first is-active answer
    s = status_summary(tools.config, platform="linux")
    assert (s["kind"], s["installed"], s["loaded"], s["running"]) == ("systemd", True, True, True)
    assert s["current"] is True
    capsys.readouterr()
    assert systemd(tools, "status") == 1
    assert "is-active: failed, is-enabled: disabled" in capsys.readouterr().out
    assert tools.calls()[-2:] == [["systemctl", "--user", "is-active", "mlxd.service"],
                                  ["systemctl", "--user", "is-enabled", "mlxd.service"]]


def test_status_summary_never_raises(tools, monkeypatch):
    from mlxd.launchd import launchctl

    def broken(config, timeout):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(launchctl, "status", broken)
    s = status_summary(tools.config, platform="darwin")
    assert s["kind"] == "launchd" and s["loaded"] is None and "unexpected" in s["detail"]
