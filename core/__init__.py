"""mlxd: dependable local MLX serving.

Components live in top-level folders and are imported under this namespace:
mlxd.engine (engine/), mlxd.gateway (gateway/), mlxd.supervisor (supervisor/),
mlxd.launchd (launchd/). This package holds what they share: the config and
the `mlxd` command.
"""

import time as _time

__version__ = "0.1.0"
# When this process started running mlxd code (before any heavy import): the
# engine reports it so that recovery time can be split into spawn and load.
STARTED_AT = _time.time()
