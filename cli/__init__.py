"""The `mlxd` command: parses the command line and runs each subcommand as a
thin shell over the components (engine, gateway, supervisor, launchd).

Entry point: `mlxd` -> mlxd.cli.main:main (also `python -m mlxd.cli`). This is
the top of the import graph: nothing imports mlxd.cli. Every file, one line
each (a test, tests/layout/test_component_maps.py, keeps this list whole):

  main.py          argument parsing and dispatch: every subcommand, `mlxd --help`
  __main__.py      `python -m mlxd.cli`: how supervisord, launchd and the runner start mlxd
  operate.py       the stack commands: up, down, restart, status (over mlxd.supervisor)
  readiness.py     waiting for a started stack: the engine's phase, then the gateway; why it cannot start
  status_format.py `mlxd status` as a table: the stack's report one line a part (pure)
  standby.py       a standby engine: imported, waiting for the runner's handover (`python -m mlxd.cli.standby`)
  preflight.py     the checks `mlxd up` makes first: each problem one line with its fix
  started_with.py  what `mlxd up` started with, remembered for the commands after it
  logs.py          `mlxd logs [component] [-f]`: the tail of a component's logs, followed
  doctor.py        `mlxd doctor`: is this machine ready to run mlxd? (changes nothing)
  models.py        `mlxd models [--json]`: every configured model, its files, estimate, verdict and state
  pull.py          `mlxd pull` / `mlxd rm`: a Hugging Face repo into the hub cache if it fits, and out again
"""
