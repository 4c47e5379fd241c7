#!/usr/bin/env bash
# Prints the path of uv at the pinned version below, for scripts/lock.sh (which
# resolves the lock with it) and scripts/setup.sh (which installs the lock with
# it): the uv on PATH when it is this version, else our own copy in the cache,
# installed there once from PyPI with pip, its wheel checked against the
# sha256 below.
#
#   scripts/uv.sh PYTHON [PIP OPTION...]
#
# PYTHON (3.8 or newer, with venv) makes the copy's virtualenv; the options go
# to that pip install (setup.sh passes fewer retries, so offline it gives up
# quickly). Exits 1, having said why on stderr, when uv cannot be had: offline
# with no copy yet, or a platform uv publishes no wheel for below.
set -euo pipefail
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

if [ $# -lt 1 ]; then
  echo "usage: $0 PYTHON [PIP OPTION...]   (prints the path of uv $uv_version)" >&2
  exit 2
fi
python="$1"; shift

if [ "$(uv --version 2>/dev/null | cut -d' ' -f2)" = "$uv_version" ]; then
  command -v uv
  exit 0
fi
tool="${XDG_CACHE_HOME:-$HOME/.cache}/mlxd/uv-$uv_version"
uv="$tool/bin/uv"
# Checked by running it: a copy left half-made (an install cut short) is made again.
if [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
  echo "==> installing uv $uv_version (once) into $tool" >&2
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  { printf 'uv==%s' "$uv_version"; printf ' --hash=sha256:%s' "${uv_hashes[@]}"; echo; } > "$work/uv.txt"
  rm -rf "$tool"
  if ! out="$({ "$python" -m venv "$tool" &&
                "$tool/bin/python" -m pip install --quiet --disable-pip-version-check \
                  --require-hashes --only-binary :all: "$@" -r "$work/uv.txt"; } 2>&1)" ||
     [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
    rm -rf "$tool"
    echo "$out" | grep -v 'is ignored: it is neither a file nor a directory' | tail -n 5 >&2
    echo "mlxd: installing uv $uv_version failed (above; uname: $(uname -sm))." >&2
    echo "  Fix: check the network to the package index, or put uv $uv_version on PATH (pip install uv==$uv_version)." >&2
    exit 1
  fi
fi
echo "$uv"
