#!/usr/bin/env bash
# Refreshes requirements-lock.txt, the lock scripts/setup.sh (and so CI) installs
# from, hash-checked (by uv, or by pip where uv can't be had): every dependency of
# pyproject.toml, the dev extra (the tests) and the build tools of our editable
# install, each pinned with the sha256 of its files, for macOS arm64 and Linux
# x86_64/aarch64 on Python 3.11 and newer. It is resolved by uv (the version that
# scripts/uv.sh pins, fetched once, hash-checked).
#
#   ./scripts/lock.sh                        keep today's pins wherever pyproject.toml allows them
#   ./scripts/lock.sh --upgrade              every pin to the newest release allowed
#   ./scripts/lock.sh --upgrade-package X    only X (and what it needs)
#
# Other arguments go to `uv pip compile`. It resolves against PyPI unless
# UV_DEFAULT_INDEX names another index; that URL is never written into the lock.
# The optional extras `cuda` and `bench` are not locked (pip install -e '.[bench]').
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lock="$root/requirements-lock.txt"
# The platforms the lock is for (uv's `environments`).
environments='[
    "sys_platform == '"'darwin'"' and platform_machine == '"'arm64'"'",
    "sys_platform == '"'linux'"' and platform_machine == '"'x86_64'"'",
    "sys_platform == '"'linux'"' and platform_machine == '"'aarch64'"'",
]'

python=""
for candidate in "${MLXD_PYTHON:-}" "$root/.venv/bin/python" python3.13 python3.12 python3.11 python3; do
  [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
  if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    python="$candidate"; break
  fi
done
if [ -z "$python" ]; then
  echo "mlxd: refreshing the lock needs Python 3.11 or newer." >&2
  echo "  Fix: run ./scripts/setup.sh first, or point MLXD_PYTHON at one." >&2
  exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# uv at its pinned version (scripts/uv.sh: the one on PATH, or our copy in the cache).
uv="$("$root/scripts/uv.sh" "$python")"
export UV_SYSTEM_CERTS="${UV_SYSTEM_CERTS:-1}"  # the platform's certificates, as pip and set-up use

# What is locked: pyproject.toml as it is, told the platforms; the build tools
# setup.sh installs first (pip itself, and build-system.requires).
cp "$root/pyproject.toml" "$work/pyproject.toml"
if grep -q '^\[tool\.uv\]' "$work/pyproject.toml"; then
  echo "mlxd: pyproject.toml has a [tool.uv] table; scripts/lock.sh adds its own." >&2
  echo "  Fix: move its settings into scripts/lock.sh (or merge environments there)." >&2
  exit 1
fi
printf '\n[tool.uv]\nenvironments = %s\n' "$environments" >> "$work/pyproject.toml"
"$python" - "$root/pyproject.toml" > "$work/build-system.txt" <<'EOF'
import sys, tomllib
print("pip")
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))
EOF
# What replaces a dependency's own declaration (its reasons are in the file); a relative path, as the
# lock's header names it.
cp "$root/scripts/lock-overrides.txt" "$work/lock-overrides.txt"
# Today's pins are uv's preferences (unless --upgrade).
[ -f "$lock" ] && cp "$lock" "$work/requirements-lock.txt"

echo "==> resolving with $("$uv" --version | cut -d' ' -f1-2) (macOS arm64, Linux x86_64 and aarch64; Python >= 3.11)"
(cd "$work" && "$uv" pip compile pyproject.toml build-system.txt \
   --extra dev --universal --python-version 3.11 --generate-hashes \
   --custom-compile-command "./scripts/lock.sh" \
   --override lock-overrides.txt \
   --quiet -o requirements-lock.txt "$@")
mv "$work/requirements-lock.txt" "$lock"
echo "    wrote requirements-lock.txt: $(grep -c '^[A-Za-z0-9]' "$lock") pins"

# The lock must agree with pyproject.toml (tests/layout/test_lock.py, offline).
if [ -x "$root/.venv/bin/python" ]; then
  (cd "$root" && .venv/bin/python -m pytest -q -p no:cacheprovider tests/layout/test_lock.py)
fi
