"""The LaunchAgent's life through launchctl, in the gui/<uid> domain (the
logged-in user's; it has the GPU and the user's keychain and files).

What launchctl answers (macOS 13-15; codes are errno values):
  bootstrap of a label already loaded  -> 5 "Input/output error" (37 "Operation
                                          already in progress", 17 on older ones)
  bootstrap right after a bootout      -> 5 too, while the old job still drains
  bootstrap with no GUI session (SSH)  -> 5 or 125 as well
  bootstrap of a disabled label        -> 119 "Service is disabled"; so `enable` comes first
  bootout / print of an unknown label  -> 3 "No such process" / 113 "Could not find service"
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from mlxd.config import Config
from mlxd.supervisor.supervisord_conf import stop_timeout_s

from .plist import LABEL, LAUNCHD_LOG, plist_bytes, render_launch_agent
from .shell import (Inputs, ServiceError, describe, message, render_inputs, require_tool, run_tool, same_content,
                    write_unit)

ALREADY_LOADED = {5, 17, 37}
NOT_LOADED = {3, 113}
POLL_S = 0.25


def plist_path() -> Path:
    base = os.environ.get("MLXD_LAUNCH_AGENTS_DIR") or Path.home() / "Library" / "LaunchAgents"
    return Path(base).expanduser() / f"{LABEL}.plist"


def domain() -> str:
    return f"gui/{os.getuid()}"


def target() -> str:
    return f"{domain()}/{LABEL}"


def _says(r, codes: set[int], *words: str) -> bool:
    text = (r.stderr + r.stdout).lower()
    return r.returncode in codes or any(w in text for w in words)


def _render(inputs: Inputs) -> bytes:
    return plist_bytes(render_launch_agent(inputs.config, inputs.argv, inputs.path_env, inputs.extra_env))


def _bootout(config: Config) -> bool:
    """Stop and unload the job (launchd gives it ExitTimeOut); False if it was not loaded."""
    r = run_tool(["launchctl", "bootout", target()], timeout=stop_timeout_s(config) + 15)
    if r.returncode == 0:
        return True
    if _says(r, NOT_LOADED, "no such process", "could not find"):
        return False
    raise ServiceError(f"launchctl bootout {target()} failed: {message(r)}")


def _wait_unloaded(config: Config, poll_s: float) -> None:
    """bootout can return while the old job still holds the label; a bootstrap
    then fails with 5. Wait (at most its ExitTimeOut) until print no longer finds it."""
    deadline = time.monotonic() + stop_timeout_s(config) + 5
    while run_tool(["launchctl", "print", target()], timeout=5).returncode == 0:
        if time.monotonic() > deadline:
            return  # the bootstrap below will say what is wrong
        time.sleep(poll_s)


def install(inputs: Inputs, poll_s: float = POLL_S) -> list[str]:
    require_tool("launchctl")  # before writing anything
    path = plist_path()
    write_unit(path, _render(inputs), inputs)
    r = run_tool(["launchctl", "enable", target()])  # clears a `launchctl disable` left from before
    if r.returncode != 0:
        raise ServiceError(f"launchctl enable {target()} failed: {message(r)}")
    bootstrap = ["launchctl", "bootstrap", domain(), str(path)]
    notes = [f"wrote {path}"]
    r = run_tool(bootstrap)
    if r.returncode != 0 and _says(r, ALREADY_LOADED, "already", "input/output error"):
        # A reinstall. launchd keeps the job as it read it at bootstrap, so
        # `kickstart -k` would restart the old definition; bootout + bootstrap
        # loads the new file (and restarts mlxd, as kickstart would).
        notes.append(f"{LABEL} was loaded already: reloading it (bootout, then bootstrap)")
        _bootout(inputs.config)
        _wait_unloaded(inputs.config, poll_s)
        r = run_tool(bootstrap)
    if r.returncode != 0:
        hint = (" (launchctl also answers this without a GUI login session, e.g. over SSH: "
                "log in at the Mac and run it again)") if r.returncode in (5, 125) else ""
        raise ServiceError(f"launchctl bootstrap {domain()} {path} failed: {message(r)}{hint}")
    log = inputs.config.paths.logs / LAUNCHD_LOG
    notes.append(f"loaded {target()}: mlxd runs now and at every login (startup errors: {log})")
    return notes


def uninstall(config: Config) -> list[str]:
    require_tool("launchctl")
    path = plist_path()
    was_loaded = _bootout(config)  # first: a plist left behind would come back at login
    path.unlink(missing_ok=True)
    return [f"{'stopped and unloaded' if was_loaded else 'was not loaded:'} {target()}", f"removed {path}"]


def status(config: Config, timeout: float) -> dict:
    path = plist_path()
    installed = path.exists()
    s = {"kind": "launchd", "installed": installed, "loaded": None, "running": None, "pid": None,
         "current": same_content(path, _render(render_inputs(config))) if installed else None,
         "path": str(path), "detail": ""}
    try:
        r = run_tool(["launchctl", "print", target()], timeout=timeout)
    except ServiceError as exc:
        return {**s, "detail": describe("launchd", installed, None, str(exc))}
    if r.returncode == 0:
        found = {k: re.search(rf"^\s*{k} = (.+)$", r.stdout, re.M) for k in ("state", "pid", "last exit code")}
        pid = int(found["pid"].group(1)) if found["pid"] and found["pid"].group(1).isdigit() else None
        facts = ", ".join(f"{k} = {m.group(1).strip()}" for k, m in found.items() if m) or target()
        s.update(loaded=True, running=pid is not None, pid=pid)
    elif _says(r, NOT_LOADED, "could not find"):
        facts = f"launchd has no {target()}"
        s.update(loaded=False, running=False)
    else:
        facts = f"launchctl print: {message(r)}"
    return {**s, "detail": describe("launchd", installed, s["loaded"], facts)}
