#!/usr/bin/env bash
# README's test command: set up the virtualenv, then run the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/engine -k stream).
#   scripts/test.sh --fast    only the pure and table tests (no model built, no
#                             process started: tests/conftest.py marks the rest
#                             `integration` from their fixtures), for the edit-test loop
# The suite runs in parallel (pytest-xdist), one worker per core up to 4 (each
# test module whole on one worker, for its shared stack): most tests wait on
# processes they started. MLXD_TEST_WORKERS=1 runs it in this process, in order.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
# No network at import: LiteLLM would otherwise fetch its cost map.
export LITELLM_LOCAL_MODEL_COST_MAP=True HF_HUB_OFFLINE=1
marks=()
if [ "${1:-}" = "--fast" ]; then
  shift
  marks=(-m "not integration")
fi
workers="${MLXD_TEST_WORKERS:-$(nproc 2>/dev/null || sysctl -n hw.ncpu)}"
[ "$workers" -gt 4 ] && workers=4
parallel=()
case " $* " in
  *" -n "*|*" --numprocesses"*|*"no:xdist"*) ;;  # the caller chose
  *) [ "$workers" -gt 1 ] && [ ${#marks[@]} -eq 0 ] && parallel=(-n "$workers" --dist loadfile) ;;
esac
exec "$root/.venv/bin/python" -m pytest ${marks[@]+"${marks[@]}"} ${parallel[@]+"${parallel[@]}"} "$@"
