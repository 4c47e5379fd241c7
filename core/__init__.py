"""mlxd: dependable local MLX serving.

Components live in top-level folders and are imported under this namespace:
mlxd.engine (engine/), mlxd.gateway (gateway/), mlxd.supervisor (supervisor/),
mlxd.launchd (launchd/). This package holds what they share: the config and
the `mlxd` command.
"""

__version__ = "0.1.0"
