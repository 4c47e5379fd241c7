#!/usr/bin/env bash
# `mlxd logs` from any directory, with no virtualenv activated; mlxd's exit
# code is this script's (status: 0 healthy, 1 degraded, 2 down).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$root/.venv/bin/mlxd" ]; then
  "$root/scripts/setup.sh" >&2
fi
exec "$root/.venv/bin/mlxd" logs "$@"
