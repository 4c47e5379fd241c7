"""launchd (macOS) and systemd (Linux) user services for mlxd, rendered from
its config: they run `mlxd up` in the foreground at login and restart it
after a crash, never after a clean `mlxd down`.

  common.py     what both units share (pure): the command, PATH and
                environment, the stop timeout derived from supervisord's
  plist.py      the LaunchAgent dev.mlxd.agent (pure: a dict, and its XML)
  systemd.py    the user unit mlxd.service (pure: its text)
  shell.py      runs launchctl/systemctl (found on PATH), gathers the inputs
  launchctl.py  install / uninstall / status with launchctl (gui/<uid>)
  systemctl.py  install / uninstall / status with systemctl --user
  service.py    `mlxd launchd|systemd install|uninstall|status` (run_command)
                and status_summary() for `mlxd status`
"""
