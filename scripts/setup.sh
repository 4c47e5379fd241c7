#!/usr/bin/env bash
# Creates (or refreshes) the project's virtualenv in .venv and installs mlxd
# into it. The dependencies come from requirements-lock.txt, each pinned and
# checked against its sha256 (pip --require-hashes; scripts/lock.sh refreshes
# it). Safe to run again: dependencies are reinstalled only when pyproject.toml
# or the lock changed (otherwise no network); our own code is always relinked
# (a strict editable install, see docs/DESIGN.md "Layout"), which takes a few
# seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
lock="$root/requirements-lock.txt"

find_python() {
  for candidate in "${MLXD_PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  found="$(command -v python3 >/dev/null 2>&1 && python3 -c 'import sys; print(sys.version.split()[0])' || echo none)"
  echo "mlxd needs Python 3.11 or newer (found: $found)." >&2
  echo "  Fix: install one (macOS: brew install python@3.12; Debian/Ubuntu: apt install python3.12 python3.12-venv)," >&2
  echo "       or point MLXD_PYTHON at one: MLXD_PYTHON=/path/to/python3.12 $0" >&2
  return 1
}

# pip's output, boiled down to one progress line (the whole log is kept for
# when it fails).
pip_with_progress() {
  local log="$venv/.mlxd-install.log" start=$SECONDS collected=0
  set +e
  "$@" >"$log" 2>&1 &
  local pid=$!
  # On a terminal one line updates in place; in a log (CI), a line every 20 s.
  local tty=0 every=20 msg
  [ -t 1 ] && tty=1 && every=1
  while kill -0 "$pid" 2>/dev/null; do
    collected=$(grep -c -E '^(Collecting|Processing) ' "$log" 2>/dev/null)
    if grep -q '^Installing collected packages' "$log" 2>/dev/null; then
      msg="installing $collected packages ($((SECONDS - start))s so far; this step takes about a minute)"
    else
      msg="downloading: $collected packages so far ($((SECONDS - start))s; usually 1-3 minutes in all)"
    fi
    if [ "$tty" = 1 ]; then printf '\r    %s      ' "$msg"; else echo "    $msg"; fi
    for _ in $(seq "$every"); do kill -0 "$pid" 2>/dev/null && sleep 1; done
  done
  wait "$pid"
  local rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    printf '\n' >&2
    grep -v 'is ignored: it is neither a file nor a directory' "$log" | tail -n 25 >&2
    echo "mlxd: installing the dependencies failed (whole log: $log)." >&2
    echo "  Fix: check the network to the package index, then run this command again." >&2
    echo "       Hashes that do not match mean a download is not the file the lock was made from: do not work around it." >&2
    return "$rc"
  fi
  if [ "$tty" = 1 ]; then printf '\r'; fi
  printf '    done: %s packages in %ss%40s\n' "$collected" $((SECONDS - start)) ""
}

if [ ! -x "$venv/bin/python" ]; then
  python="$(find_python)"
  echo "==> [1/3] creating the virtualenv .venv with $python"
  if ! "$python" -m venv "$venv"; then
    rm -rf "$venv"
    echo "mlxd: $python cannot create a virtualenv." >&2
    echo "  Fix: install its venv module (Debian/Ubuntu: apt install python3-venv), then run this command again." >&2
    exit 1
  fi
fi

if [ ! -f "$lock" ]; then
  echo "mlxd: requirements-lock.txt is missing (the pinned, hash-checked dependencies)." >&2
  echo "  Fix: restore it (git checkout -- requirements-lock.txt), or make it again: ./scripts/lock.sh" >&2
  exit 1
fi
stamp="$venv/.mlxd-deps"
want="$(cat "$root/pyproject.toml" "$lock" | sha256sum | cut -d' ' -f1)"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
relink=("${pip[@]}" install --quiet --no-deps --no-build-isolation -e "$root" --config-settings editable_mode=strict)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "==> [2/3] installing mlxd and its dependencies (MLX, mlx-lm, LiteLLM, supervisord; pinned and hash-checked; first run only)"
  # pip and the build tools first, from their entries in the lock.
  awk '/^[^ #]/ { keep = /^(pip|setuptools|wheel)==/ } keep' "$lock" > "$venv/.mlxd-build-tools.txt"
  if ! out="$("${pip[@]}" install --quiet --require-hashes --no-deps -r "$venv/.mlxd-build-tools.txt" 2>&1)"; then
    echo "$out" | grep -v 'is ignored: it is neither a file nor a directory' >&2
    echo "mlxd: installing pip and the build tools from requirements-lock.txt failed." >&2
    echo "  Fix: check the network to the package index, then run this command again." >&2
    exit 1
  fi
  pip_with_progress "${pip[@]}" install --require-hashes --no-deps -r "$lock"
  if ! out="$("${relink[@]}" 2>&1)"; then
    echo "$out" >&2
    exit 1
  fi
  # --no-deps trusts the lock to hold every dependency; pip check proves it did.
  if ! out="$("${pip[@]}" check 2>&1)"; then
    echo "$out" >&2
    echo "mlxd: the installed dependencies do not fit together (above)." >&2
    echo "  Fix: if .venv holds packages from an older set-up, rm -rf .venv and run this command again; else refresh the lock: ./scripts/lock.sh" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
else
  # Relink our own files (new modules need it in strict mode); no network.
  if ! out="$("${relink[@]}" 2>&1)"; then
    echo "$out" >&2
    exit 1
  fi
fi

# The fast CPU path on Linux (engine/fast_blas.py): OpenBLAS under MLX, through a
# shim to the scipy-openblas32 wheel built once (a C compiler is needed; without
# one MLX keeps its slow reference BLAS, and `mlxd doctor` says how to fix it).
if [ "$(uname -s)" = Linux ] && [ ! -f "$venv/lib/mlxd/libmlxd_blas.so" ]; then
  "$venv/bin/python" -m mlxd.engine.fast_blas build
fi

# The real default model, once (see core/default_model.py); offline, the demo model serves.
if [ ! -f "$("$venv/bin/python" -c 'from mlxd.default_model import gguf_path; print(gguf_path())')" ]; then
  echo "==> [3/3] fetching the default model, SmolLM2-135M-Instruct (once)"
  "$venv/bin/python" -m mlxd.default_model
fi
