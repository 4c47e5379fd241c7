"""launchd (macOS) and systemd (Linux) user services for mlxd, rendered from
its config: they run `mlxd up` in the foreground at login and restart it
after a crash, never after a clean `mlxd down`.

Entry point: `mlxd launchd|systemd install|uninstall|status` ->
mlxd.launchd.service.run_command. Every file, one line each (a test,
tests/layout/test_component_maps.py, keeps this list whole):

  service.py    the commands (run_command), and status_summary() for `mlxd status`
  common.py     what both units share (pure): the command, PATH, environment, stop timeout
  plist.py      the LaunchAgent dev.mlxd.agent (pure: a dict, and its XML)
  systemd.py    the user unit mlxd.service (pure: its text)
  launchctl.py  install / uninstall / status with launchctl (gui/<uid>)
  systemctl.py  install / uninstall / status with systemctl --user
  shell.py      runs launchctl/systemctl (found on PATH), gathers what a unit is rendered from
"""
