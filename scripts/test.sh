#!/usr/bin/env bash
# README's test command: set up the virtualenv, then run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/engine -k stream).
#   scripts/test.sh --fast    only the pure and table tests (no model built, no
#                             process started: tests/conftest.py marks the rest
#                             `integration` from their fixtures), for the edit-test loop
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
# No network at import: LiteLLM would otherwise fetch its cost map.
export LITELLM_LOCAL_MODEL_COST_MAP=True HF_HUB_OFFLINE=1
if [ "${1:-}" = "--fast" ]; then
  shift
  exec "$root/.venv/bin/python" -m pytest -m "not integration" "$@"
fi
exec "$root/.venv/bin/python" -m pytest "$@"
