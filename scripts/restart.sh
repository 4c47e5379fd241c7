#!/usr/bin/env bash
# `mlxd restart` from any directory, with no virtualenv activated; mlxd's exit
# code is this script's (0 restarted and ready, 1 not ready, 2 not running).
# It restarts the stack `mlxd up` started in $MLXD_HOME, as it was started
# (remembered in $MLXD_HOME/run/started_with.json); an MLXD_* variable set now wins.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$root/.venv/bin/mlxd" ]; then
  "$root/scripts/setup.sh" >&2
fi
exec "$root/.venv/bin/mlxd" restart "$@"
