#!/usr/bin/env bash
# README's run command: set up the virtualenv, then run mlxd in the foreground
# (the engine on the built-in demo model unless $MLXD_HOME/mlxd.toml names a
# real one). Extra arguments go to `mlxd engine`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
export LITELLM_LOCAL_MODEL_COST_MAP=True
exec "$root/.venv/bin/mlxd" engine "$@"
