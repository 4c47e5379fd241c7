"""`mlxd launchd|systemd install|uninstall|status`, and the service summary
that `mlxd status` can show: a launchd LaunchAgent on macOS (launchctl.py), a
systemd user unit elsewhere (systemctl.py).

Environment overrides (tests use them to keep away from the real ones):
  MLXD_LAUNCH_AGENTS_DIR  where the plist goes (default ~/Library/LaunchAgents)
  MLXD_SYSTEMD_USER_DIR   where the unit goes (default ~/.config/systemd/user)
"""

from __future__ import annotations

import argparse
import sys

from mlxd.config import Config

from . import launchctl, systemctl
from .shell import ServiceError, render_inputs

STATUS_TIMEOUT_S = 2.0  # per tool call: a status must stay quick
MODULES = {"launchd": launchctl, "systemd": systemctl}


def status_summary(config: Config, platform: str | None = None) -> dict:
    """launchd on macOS, systemd elsewhere. Never raises. Keys: kind,
    installed (the file exists), loaded (launchd: bootstrapped; systemd:
    enabled; None when unknown), running, pid, current (the file is what
    install would write now), path, detail."""
    kind = "launchd" if (platform or sys.platform) == "darwin" else "systemd"
    try:
        return MODULES[kind].status(config, STATUS_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 -- a status must never take `mlxd status` down
        return {"kind": kind, "installed": False, "loaded": None, "running": None, "pid": None,
                "current": None, "path": None, "detail": f"{type(exc).__name__}: {exc}"}


def format_summary(s: dict) -> str:
    lines = [f"{s['kind']}: {s['detail']}"]
    if s.get("path"):
        lines.append(f"  file: {s['path']}")
    if s["installed"] and s.get("current") is False:
        lines.append(f"  the installed file differs from the current config: `mlxd {s['kind']} install` again")
    return "\n".join(lines)


def run_command(args: argparse.Namespace, config: Config) -> int:
    """args.platform: "launchd" | "systemd"; args.action: "install" |
    "uninstall" | "status"; args.config (optional): the --config file.
    Exit 0 on success (status: installed and loaded); 1 on failure (status:
    one of the two, or unknown); 2 when status finds neither."""
    module = MODULES[args.platform]
    if args.action == "status":
        s = status_summary(config, "darwin" if args.platform == "launchd" else "linux")
        print(format_summary(s))
        if s["installed"] and s["loaded"]:
            return 0
        return 2 if not s["installed"] and s["loaded"] is False else 1
    try:
        if args.action == "install":
            notes = module.install(render_inputs(config, getattr(args, "config", None)))
        elif args.action == "uninstall":
            notes = module.uninstall(config)
        else:
            raise ServiceError(f"unknown action {args.action!r}")
    except ServiceError as exc:
        print(f"mlxd: {exc}", file=sys.stderr)
        return 1
    print("\n".join(notes))
    return 0
