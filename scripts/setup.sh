#!/usr/bin/env bash
# Creates (or refreshes) the project's virtualenv in .venv and installs mlxd
# into it. The dependencies come from requirements-lock.txt, each pinned and
# checked against its sha256 (scripts/lock.sh refreshes it), installed by uv
# (the version scripts/uv.sh pins, fetched once into ~/.cache/mlxd; its own
# cache, ~/.cache/uv, makes a second set-up quick and offline-capable), or by
# pip (--require-hashes) where uv can't be had (offline with no copy of it yet,
# a platform it has no wheel for) or fails; MLXD_NO_UV=1 takes pip. Safe to run
# again: dependencies are reinstalled only when pyproject.toml or the lock
# changed (otherwise no network); our own code is always relinked (a strict
# editable install, see docs/DESIGN.md "Layout"), which takes a few seconds.
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

# An installer's output, boiled down to one progress line; the whole log is
# kept in $1 (shown when it fails). $2 says whose log it is: pip or uv.
# Returns the installer's exit status; on success, prints the closing line.
# Whether every incompatibility a dependency check reports ($1) is one that
# scripts/lock-overrides.txt makes on purpose (a line naming an overridden package).
only_overridden() {
  local names line found=0
  names="$(sed -e 's/#.*//' -e 's/[<>=!~ ;].*//' "$root/scripts/lock-overrides.txt" | grep -v '^$' | paste -sd'|' -)"
  [ -n "$names" ] || return 1
  while IFS= read -r line; do
    case "$line" in
      *"requires \`"*|*" has requirement "*)
        if printf '%s\n' "$line" | grep -Eq "(requires \`|has requirement )($names)[<>=!~ ,]"; then found=1; else return 1; fi ;;
    esac
  done <<<"$1"
  [ "$found" = 1 ]
}

install_with_progress() {
  local log="$1" tool="$2" start=$SECONDS count=0
  shift 2
  set +e
  "$@" >"$log" 2>&1 &
  local pid=$!
  # On a terminal one line updates in place; in a log (CI), a line every 20 s.
  local tty=0 every=20 msg
  [ -t 1 ] && tty=1 && every=1
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$tool" = uv ]; then
      count=$(awk '/^Resolved [0-9]+ package/ { print $2; exit }' "$log" 2>/dev/null)
      if [ -n "$count" ]; then
        msg="fetching and installing $count packages ($((SECONDS - start))s so far; from uv's cache when there)"
      else
        msg="finding the locked files on the package index ($((SECONDS - start))s so far)"
      fi
    else
      count=$(grep -c -E '^(Collecting|Processing) ' "$log" 2>/dev/null)
      if grep -q '^Installing collected packages' "$log" 2>/dev/null; then
        msg="installing $count packages ($((SECONDS - start))s so far; this step takes about a minute)"
      else
        msg="downloading: $count packages so far ($((SECONDS - start))s; usually 1-3 minutes in all)"
      fi
    fi
    if [ "$tty" = 1 ]; then printf '\r    %s      ' "$msg"; else echo "    $msg"; fi
    for _ in $(seq "$every"); do kill -0 "$pid" 2>/dev/null && sleep 1; done
  done
  wait "$pid"
  local rc=$?
  set -e
  if [ "$tty" = 1 ]; then printf '\r%100s\r' ""; fi
  [ "$rc" -eq 0 ] || return "$rc"
  if [ "$tool" = uv ]; then
    count=$(awk '/^(Installed|Audited) [0-9]+ package/ { print $2; exit }' "$log")
  else
    count=$(grep -c -E '^(Collecting|Processing) ' "$log" || true)
  fi
  printf '    done: %s packages in %ss (%s)\n' "${count:-0}" $((SECONDS - start)) "$tool"
}

install_failed() {
  grep -v 'is ignored: it is neither a file nor a directory' "$1" | tail -n 25 >&2
  echo "mlxd: installing the dependencies failed (whole log: $1)." >&2
  echo "  Fix: check the network to the package index, then run this command again." >&2
  echo "       Hashes that do not match mean a download is not the file the lock was made from: do not work around it." >&2
  exit 1
}

# Bytecode, which uv (unlike pip) does not write. Compiling all 22,000 modules
# takes 100 s of CPU (a minute or more on 2 cores); the service imports 4,000 of
# them as it starts (the gateway's LiteLLM proxy, the engine's MLX stack), which
# would otherwise be compiled in memory at every start where
# PYTHONDONTWRITEBYTECODE is set. So those are imported once here, writing their
# bytecode (whatever PYTHONDONTWRITEBYTECODE says, as pip's install did), in the
# background while set-up goes on; finish_bytecode awaits them. Only speed hangs
# on it: an import failing here is left to the service to report. A marker
# makes set-up cut short meanwhile do it again next time.
bytecode_pids=()
start_bytecode() {
  local modules
  touch "$venv/.mlxd-bytecode-pending"
  bytecode_start=$SECONDS
  : > "$venv/.mlxd-bytecode.log"
  for modules in litellm.proxy.proxy_server \
                 mlx_lm.utils,transformers,supervisor.supervisord,uvicorn,prometheus_client; do
    env -u PYTHONDONTWRITEBYTECODE LITELLM_LOCAL_MODEL_COST_MAP=True HF_HUB_OFFLINE=1 \
      "$venv/bin/python" -c "import $modules" >>"$venv/.mlxd-bytecode.log" 2>&1 </dev/null &
    bytecode_pids+=($!)
  done
  # Set-up failing meanwhile stops them.
  trap '[ ${#bytecode_pids[@]} -eq 0 ] || kill "${bytecode_pids[@]}" 2>/dev/null || true' EXIT
}

finish_bytecode() {
  local pid failed=0
  if [ -t 1 ] && kill -0 "${bytecode_pids[@]}" 2>/dev/null; then
    printf '    compiling what the service imports (once)...'
  fi
  for pid in "${bytecode_pids[@]}"; do wait "$pid" || failed=1; done
  bytecode_pids=()
  [ -t 1 ] && printf '\r%60s\r' ""
  rm -f "$venv/.mlxd-bytecode-pending"
  if [ "$failed" = 1 ]; then
    echo "    bytecode: an import failed (see .venv/.mlxd-bytecode.log); the service will say why"
  else
    echo "    bytecode for what the service imports: $((SECONDS - bytecode_start))s (once)"
  fi
}

if [ ! -f "$lock" ]; then
  echo "mlxd: requirements-lock.txt is missing (the pinned, hash-checked dependencies)." >&2
  echo "  Fix: restore it (git checkout -- requirements-lock.txt), or make it again: ./scripts/lock.sh" >&2
  exit 1
fi
stamp="$venv/.mlxd-deps"
want="$(cat "$root/pyproject.toml" "$lock" | sha256sum | cut -d' ' -f1)"
deps=0
[ "$(cat "$stamp" 2>/dev/null)" = "$want" ] || deps=1

python=""
[ -x "$venv/bin/python" ] || python="$(find_python)"

# uv, when the dependencies are to be installed (scripts/uv.sh; once per
# machine, then from ~/.cache/mlxd). Offline with no copy yet, pip gives up
# after one retry and pip installs instead.
uv=""
# The platform's certificate store, as pip uses: behind a proxy that re-signs
# TLS (a company network), uv's own roots refused the index and pip had to do
# the whole install (here 112 s against 3 s). A value set by the user stands.
export UV_SYSTEM_CERTS="${UV_SYSTEM_CERTS:-1}"
if [ "$deps" = 1 ] && [ "${MLXD_NO_UV:-}" != 1 ]; then
  uv_err="$(mktemp)"
  if ! uv="$("$root/scripts/uv.sh" "${python:-$venv/bin/python}" --retries 1 --timeout 20 2>"$uv_err")"; then
    uv=""
    echo "    uv could not be had ($(grep -m1 -E '^(ERROR|error|mlxd):' "$uv_err" || tail -n 1 "$uv_err")); pip installs instead"
  else
    cat "$uv_err"
  fi
  rm -f "$uv_err"
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "==> [1/3] creating the virtualenv .venv with $python"
  # With uv, pip comes from the lock like the rest (ensurepip's copy would be replaced).
  without_pip=()
  [ -n "$uv" ] && without_pip=(--without-pip)
  if ! "$python" -m venv ${without_pip[@]+"${without_pip[@]}"} "$venv"; then
    rm -rf "$venv"
    echo "mlxd: $python cannot create a virtualenv." >&2
    echo "  Fix: install its venv module (Debian/Ubuntu: apt install python3-venv), then run this command again." >&2
    exit 1
  fi
fi

pip=("$venv/bin/python" -m pip --disable-pip-version-check)
relink=("${pip[@]}" install --quiet --no-deps --no-build-isolation -e "$root" --config-settings editable_mode=strict)
if [ "$deps" = 1 ]; then
  echo "==> [2/3] installing mlxd and its dependencies (MLX, mlx-lm, LiteLLM, supervisord; pinned and hash-checked; first run only)"
  installer=""
  if [ -n "$uv" ]; then
    # Hardlinks from uv's cache where it is on the venv's filesystem; else
    # copies, said up front (uv would warn of the fallback).
    if [ -z "${UV_LINK_MODE:-}" ] && ! "$venv/bin/python" - "$("$uv" cache dir)" "$venv" <<'EOF'
import os, sys
def dev(path):
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return os.stat(path or ".").st_dev
sys.exit(dev(sys.argv[1]) != dev(sys.argv[2]))
EOF
    then
      export UV_LINK_MODE=copy
    fi
    uv_install=("$uv" pip install --require-hashes --no-deps -r "$lock" --python "$venv/bin/python")
    uv_log="$venv/.mlxd-install-uv.log"
    # Offline, uv's cached index pages may be stale: then it is asked again
    # --offline, to install from its cache alone (still hash-checked).
    if install_with_progress "$uv_log" uv "${uv_install[@]}" ||
       { grep -q -E 'Failed to fetch|error sending request|dns error|timed out' "$uv_log" &&
         install_with_progress "$venv/.mlxd-install-uv-offline.log" uv "${uv_install[@]}" --offline; }; then
      installer=uv
    else
      echo "    uv could not install them ($(grep -m1 '^error:' "$uv_log" || tail -n 1 "$uv_log"); its log: $uv_log); pip installs instead"
    fi
  fi
  if [ -z "$installer" ]; then
    installer=pip
    # A venv made for uv has no pip yet.
    if ! "${pip[@]}" --version >/dev/null 2>&1; then
      "$venv/bin/python" -m ensurepip --default-pip >/dev/null
    fi
    # pip and the build tools first, from their entries in the lock.
    awk '/^[^ #]/ { keep = /^(pip|setuptools|wheel)==/ } keep' "$lock" > "$venv/.mlxd-build-tools.txt"
    if ! out="$("${pip[@]}" install --quiet --require-hashes --no-deps -r "$venv/.mlxd-build-tools.txt" 2>&1)"; then
      echo "$out" | grep -v 'is ignored: it is neither a file nor a directory' >&2
      echo "mlxd: installing pip and the build tools from requirements-lock.txt failed." >&2
      echo "  Fix: check the network to the package index, then run this command again." >&2
      exit 1
    fi
    install_with_progress "$venv/.mlxd-install.log" pip "${pip[@]}" install --require-hashes --no-deps -r "$lock" ||
      install_failed "$venv/.mlxd-install.log"
  fi
  # uv (unlike pip) writes no bytecode: see start_bytecode.
  [ "$installer" = uv ] && start_bytecode
  # The first relink writes pip's and setuptools' bytecode too (uv wrote none).
  if ! out="$(env -u PYTHONDONTWRITEBYTECODE "${relink[@]}" 2>&1)"; then
    echo "$out" >&2
    exit 1
  fi
  # --no-deps trusts the lock to hold every dependency; the check proves it did, but for the
  # requirements scripts/lock-overrides.txt replaces on purpose (its comments say why).
  check=("${pip[@]}" check)
  [ "$installer" = uv ] && check=("$uv" pip check --python "$venv/bin/python")
  if ! out="$("${check[@]}" 2>&1)" && ! only_overridden "$out"; then
    echo "$out" >&2
    echo "mlxd: the installed dependencies do not fit together (above)." >&2
    echo "  Fix: if .venv holds packages from an older set-up, rm -rf .venv and run this command again; else refresh the lock: ./scripts/lock.sh" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
else
  [ -f "$venv/.mlxd-bytecode-pending" ] && start_bytecode
  # Relink our own files (new modules need it in strict mode); no network.
  if ! out="$("${relink[@]}" 2>&1)"; then
    echo "$out" >&2
    exit 1
  fi
fi

# The fast CPU path on Linux (engine/cpu/fast_blas.py): OpenBLAS under MLX, through a
# shim to the scipy-openblas32 wheel built once per shim version (a C compiler is
# needed; without one the system's OpenBLAS or MLX's slow reference BLAS serves,
# and `mlxd doctor` says how to fix it).
if [ "$(uname -s)" = Linux ]; then
  "$venv/bin/python" -m mlxd.engine.cpu.fast_blas build
fi

# The real default model, once (see core/default_model.py); offline, the demo model serves.
if [ ! -f "$("$venv/bin/python" -c 'from mlxd.default_model import gguf_path; print(gguf_path())')" ]; then
  echo "==> [3/3] fetching the default model, SmolLM2-135M-Instruct (once; 93 MB)"
  "$venv/bin/python" -m mlxd.default_model
fi
# ...and the default embedding model, all-MiniLM-L6-v2 (core/default_embedding.py); offline, Ollama's twin serves.
if ! "$venv/bin/python" -c 'import sys; from mlxd.default_embedding import fetched; sys.exit(not fetched())'; then
  echo "==> [3/3] fetching the default embedding model, all-MiniLM-L6-v2 (once; 84 MB)"
  "$venv/bin/python" -m mlxd.default_embedding
fi

if [ ${#bytecode_pids[@]} -gt 0 ]; then finish_bytecode; fi
