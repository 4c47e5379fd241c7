#!/usr/bin/env bash
# README's run command: set up the virtualenv, then run mlxd in the foreground:
# supervisord with the engine (on the built-in demo model unless
# $MLXD_HOME/mlxd.toml names a real one) and the crash listener. Ctrl-C stops
# it all. Extra arguments go to `mlxd up` (e.g. --detach).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
export LITELLM_LOCAL_MODEL_COST_MAP=True
exec "$root/.venv/bin/mlxd" up "$@"
