"""The systemd user unit's life through `systemctl --user`.

A user service stops when the user's last session ends unless lingering is
on (`loginctl enable-linger $USER`); install says so.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxd.config import Config
from mlxd.supervisor.supervisord_conf import stop_timeout_s

from .shell import (Inputs, ServiceError, describe, message, render_inputs, require_tool, run_tool, same_content,
                    write_unit)
from .systemd import UNIT_NAME, render_systemd_unit


def unit_path() -> Path:
    base = os.environ.get("MLXD_SYSTEMD_USER_DIR")
    if not base:
        config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
        base = Path(config_home) / "systemd" / "user"
    return Path(base).expanduser() / UNIT_NAME


def _render(inputs: Inputs) -> bytes:
    return render_systemd_unit(inputs.config, inputs.argv, inputs.path_env, inputs.extra_env).encode()


def _systemctl(*args: str, timeout: float = 30.0, tolerate: tuple[str, ...] = ()) -> None:
    r = run_tool(["systemctl", "--user", *args], timeout=timeout)
    if r.returncode != 0 and not any(w in message(r).lower() for w in tolerate):
        raise ServiceError(f"systemctl --user {' '.join(args)} failed: {message(r)}")


def install(inputs: Inputs) -> list[str]:
    require_tool("systemctl")  # before writing anything
    path = unit_path()
    was_running = run_tool(["systemctl", "--user", "is-active", UNIT_NAME]).returncode == 0
    write_unit(path, _render(inputs), inputs)
    _systemctl("daemon-reload")
    _systemctl("enable", "--now", UNIT_NAME)
    if was_running:  # a reinstall: `enable --now` leaves it running as it was; apply the new file
        _systemctl("restart", UNIT_NAME, timeout=stop_timeout_s(inputs.config) + 30)
    return [f"wrote {path}", f"enabled and started {UNIT_NAME} (logs: journalctl --user -u {UNIT_NAME})",
            "to keep it running after you log out: loginctl enable-linger $USER"]


def uninstall(config: Config) -> list[str]:
    require_tool("systemctl")
    path = unit_path()
    # Stopping runs ExecStop (`mlxd down`): allow for the whole drain.
    _systemctl("disable", "--now", UNIT_NAME, timeout=stop_timeout_s(config) + 30,
               tolerate=("does not exist", "not loaded", "not found", "no such file"))
    path.unlink(missing_ok=True)
    _systemctl("daemon-reload")
    return [f"stopped and disabled {UNIT_NAME}", f"removed {path}"]


def status(config: Config, timeout: float) -> dict:
    path = unit_path()
    installed = path.exists()
    s = {"kind": "systemd", "installed": installed, "loaded": None, "running": None, "pid": None,
         "current": same_content(path, _render(render_inputs(config))) if installed else None,
         "path": str(path), "detail": ""}
    try:
        active = run_tool(["systemctl", "--user", "is-active", UNIT_NAME], timeout=timeout)
        enabled = run_tool(["systemctl", "--user", "is-enabled", UNIT_NAME], timeout=timeout)
    except ServiceError as exc:
        return {**s, "detail": describe("systemd", installed, None, str(exc))}
    a, e = active.stdout.strip(), enabled.stdout.strip()
    if not a:  # no answer at all: e.g. no user manager ("Failed to connect to bus")
        return {**s, "detail": describe("systemd", installed, None, f"systemctl --user: {message(active)}")}
    loaded = e in ("enabled", "enabled-runtime", "linked", "linked-runtime")
    facts = f"is-active: {a}, is-enabled: {e or message(enabled)}"
    return {**s, "loaded": loaded, "running": a == "active", "detail": describe("systemd", installed, loaded, facts,
                                                                                  "enabled")}
