#!/usr/bin/env bash
# Refreshes requirements-lock.txt, the lock scripts/setup.sh (and so CI) installs
# from with pip's hash checking: every dependency of pyproject.toml, the dev extra
# (the tests) and the build tools of our editable install, each pinned with the
# sha256 of its files, for macOS arm64 and Linux x86_64/aarch64 on Python 3.11 and
# newer. It is resolved by uv (the version below, fetched once, hash-checked).
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
uv_version=0.13.9
# PyPI's sha256 of uv's wheels for macOS arm64/x86_64 and Linux x86_64/aarch64.
uv_hashes=(
  66c512266d633bef48384a1f53003f41f2a8e7b36fe6e7fbfd3e0fd52d96fa63  # macosx_11_0_arm64
  c16ed11e013557536b3e60065f1b912f6407bd6518e041b961e23ef9e6b4fbf5  # macosx_10_12_x86_64
  d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19  # manylinux_2_17_x86_64
  2c45530751517d6c3bbc69a19473f6effe47cce047bede01ffd8af7ea7b36b25  # musllinux_1_1_x86_64
  5435c5ce14a56431208ca0996416d310f1598e8c2c8ba707688985a16bb82dbe  # manylinux_2_17_aarch64
  ecb6028d79dc96fbeafffe5c8af62a7099487ebc05a701e76714eebcffd06375  # manylinux_2_28_aarch64
)
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

# uv: the one on PATH when it is this version, else our own copy in the cache.
uv=uv
if [ "$(uv --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
  tool="${XDG_CACHE_HOME:-$HOME/.cache}/mlxd/uv-$uv_version"
  uv="$tool/bin/uv"
  if [ ! -x "$uv" ]; then
    echo "==> installing uv $uv_version (once) into $tool"
    { printf 'uv==%s' "$uv_version"; printf ' --hash=sha256:%s' "${uv_hashes[@]}"; echo; } > "$work/uv.txt"
    rm -rf "$tool"
    if ! { "$python" -m venv "$tool" &&
           "$tool/bin/python" -m pip install --quiet --disable-pip-version-check \
             --require-hashes --only-binary :all: -r "$work/uv.txt"; }; then
      rm -rf "$tool"
      echo "mlxd: installing uv $uv_version failed (see above)." >&2
      echo "  Fix: check the network to the package index, or put uv $uv_version on PATH (pip install uv==$uv_version), then run this again." >&2
      exit 1
    fi
  fi
fi

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
# Today's pins are uv's preferences (unless --upgrade).
[ -f "$lock" ] && cp "$lock" "$work/requirements-lock.txt"

echo "==> resolving with uv $uv_version (macOS arm64, Linux x86_64 and aarch64; Python >= 3.11)"
(cd "$work" && "$uv" pip compile pyproject.toml build-system.txt \
   --extra dev --universal --python-version 3.11 --generate-hashes \
   --custom-compile-command "./scripts/lock.sh" \
   --quiet -o requirements-lock.txt "$@")
mv "$work/requirements-lock.txt" "$lock"
echo "    wrote requirements-lock.txt: $(grep -c '^[A-Za-z0-9]' "$lock") pins"

# The lock must agree with pyproject.toml (tests/layout/test_lock.py, offline).
if [ -x "$root/.venv/bin/python" ]; then
  (cd "$root" && .venv/bin/python -m pytest -q -p no:cacheprovider tests/layout/test_lock.py)
fi
