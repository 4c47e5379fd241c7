#!/usr/bin/env bash
# Creates (or refreshes) the project's virtualenv in .venv and installs mlxd
# into it. Safe to run again: dependencies are reinstalled only when
# pyproject.toml changed; our own code is always relinked (strict editable
# install, see DESIGN.md "Layout"), which takes a few seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"

find_python() {
  for candidate in "${MLXD_PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "mlxd needs Python 3.11 or newer (set MLXD_PYTHON to one)" >&2
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  python="$(find_python)"
  echo "==> creating virtualenv $venv with $python"
  "$python" -m venv "$venv"
fi

stamp="$venv/.mlxd-deps"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "==> installing dependencies (first run takes a minute or two)"
  "${pip[@]}" install --quiet --upgrade pip "setuptools>=77" wheel
  "${pip[@]}" install --quiet -e "$root[dev]" --config-settings editable_mode=strict
  echo "$want" > "$stamp"
else
  # Relink our own files (new modules need it in strict mode); no network.
  if ! out="$("${pip[@]}" install --quiet --no-deps --no-build-isolation -e "$root" \
              --config-settings editable_mode=strict 2>&1)"; then
    echo "$out" >&2
    exit 1
  fi
fi
