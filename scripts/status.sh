#!/usr/bin/env bash
# `mlxd status` from any directory, with no virtualenv activated; mlxd's exit
# code is this script's (0 healthy, 1 degraded, 2 down). It reaches the stack
# `mlxd up` started in $MLXD_HOME on the ports it was started with (remembered
# in $MLXD_HOME/run/started_with.json); an MLXD_* variable set now wins.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$root/.venv/bin/mlxd" ]; then
  "$root/scripts/setup.sh" >&2
fi
exec "$root/.venv/bin/mlxd" status "$@"
