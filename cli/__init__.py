"""The `mlxd` command: parses the command line and runs each subcommand as a
thin shell over the components (engine, gateway, supervisor, launchd).

Entry point: `mlxd` -> mlxd.cli.main:main (also `python -m mlxd.cli`). This is
the top of the import graph: nothing imports mlxd.cli.
"""
