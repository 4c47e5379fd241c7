#!/usr/bin/env bash
# `mlxd logs` from any directory, with no virtualenv activated; mlxd's exit
# code is this script's (0 shown, 1 no logs yet). The logs are those of the
# stack `mlxd up` started in $MLXD_HOME (with the config file it was started with).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$root/.venv/bin/mlxd" ]; then
  "$root/scripts/setup.sh" >&2
fi
exec "$root/.venv/bin/mlxd" logs "$@"
