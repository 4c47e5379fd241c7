"""The fast CPU path on Linux: an optimised BLAS under MLX's CPU backend.

MLX's Linux CPU wheel (mlx-cpu) ships the reference (netlib) BLAS, and its
float32 matmuls -- a prompt's prefill -- run many times slower on it than on
OpenBLAS (docs/BENCHMARKS.md, "The CPU path's layouts"). MLX resolves
`cblas_sgemm` when `mlx.core` is first imported, and the dynamic loader
searches libraries loaded with RTLD_GLOBAL before the module's own: loading
an OpenBLAS that way first puts it under MLX, with no LD_PRELOAD and no
rebuild of MLX. Two sources, the first found wins:

- the `scipy-openblas32` wheel (a dependency on Linux), whose symbols carry a
  `scipy_` prefix: set-up compiles a small shim (`cblas_*` -> `scipy_cblas_*`)
  next to the virtualenv's Python (`python -m mlxd.engine.cpu.fast_blas build`).
  It also sends one-row float32 products -- every layer of a decoded token --
  to sgemv instead of sgemm (sgemm packs the weights before it reads them,
  sgemv streams them once: decode faster);
- the system's OpenBLAS (Debian/Ubuntu `libopenblas0-pthread`), whose
  symbols carry the standard names (without a C compiler for the shim).

Nothing changes on macOS (Metal; Accelerate under the CPU backend).
`weights_dtype_on_cpu` is the other half of the path: with a fast BLAS,
float32 weights are the fastest on the CPU (quantised matmuls are MLX's own
kernels, not BLAS), so small models are loaded as float32 there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("mlxd.engine.cpu.fast_blas")

OPT_OUT_ENV = "MLXD_CPU_BLAS"  # "reference": keep MLX's own BLAS (to compare, or to rule it out)
SHIM_STEM = "libmlxd_blas"
# The standard names MLX's CPU backend calls (`nm -D libmlx.so`: it calls
# only cblas_sgemm/dgemm/cgemm, always row-major), forwarded; a one-row
# float32 product (a decoded token through a layer: M = 1) goes to sgemv,
# which streams the weights once where sgemm packs them first (faster on
# every layer of the default model: bench/one_row_products.py).
SHIM_SOURCE = """\
/* mlxd: standard CBLAS names for the scipy-openblas32 wheel's prefixed ones (engine/cpu/fast_blas.py). */
#include <string.h>
typedef int blasint;
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
extern void scipy_cblas_sgemm(int, int, int, blasint, blasint, blasint, float, const float *, blasint,
                              const float *, blasint, float, float *, blasint);
extern void scipy_cblas_sgemv(int, int, blasint, blasint, float, const float *, blasint, const float *, blasint,
                              float, float *, blasint);
extern void scipy_cblas_dgemm(int, int, int, blasint, blasint, blasint, double, const double *, blasint,
                              const double *, blasint, double, double *, blasint);
extern void scipy_cblas_cgemm(int, int, int, blasint, blasint, blasint, const void *, const void *, blasint,
                              const void *, blasint, const void *, void *, blasint);
void cblas_sgemm(int o, int ta, int tb, blasint m, blasint n, blasint k, float alpha, const float *a, blasint lda,
                 const float *b, blasint ldb, float beta, float *c, blasint ldc) {
  if (o == ROW_MAJOR && m == 1 && n > 1 && k > 0) {
    /* c (1 x n) = alpha a (1 x k) op(b) + beta c, as y = op(b)^T x. The row a is contiguous, or a column of a
       k x lda matrix when transposed. MLX leaves c uninitialised when beta is 0: clear it, so garbage (a NaN)
       never leaks through a BLAS that scales y by multiplying. */
    if (beta == 0.0f) memset(c, 0, sizeof(float) * (size_t)n);
    if (tb == NO_TRANS)
      scipy_cblas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, ta == NO_TRANS ? 1 : lda, beta, c, 1);
    else
      scipy_cblas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, ta == NO_TRANS ? 1 : lda, beta, c, 1);
    return;
  }
  scipy_cblas_sgemm(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void cblas_dgemm(int o, int ta, int tb, blasint m, blasint n, blasint k, double alpha, const double *a, blasint lda,
                 const double *b, blasint ldb, double beta, double *c, blasint ldc) {
  scipy_cblas_dgemm(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void cblas_cgemm(int o, int ta, int tb, blasint m, blasint n, blasint k, const void *alpha, const void *a,
                 blasint lda, const void *b, blasint ldb, const void *beta, void *c, blasint ldc) {
  scipy_cblas_cgemm(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""
# The shim's file name carries its source's digest: a set-up after an
# upgrade builds the new one beside the old (which nothing loads any more).
SHIM_NAME = f"{SHIM_STEM}-{hashlib.sha256(SHIM_SOURCE.encode()).hexdigest()[:12]}.so"
# Debian/Ubuntu's OpenBLAS, by the names its packages install (the loader's path finds them).
SYSTEM_OPENBLAS = ("libopenblas.so.0", "libopenblas.so")
FIX = ("install OpenBLAS (Debian/Ubuntu: sudo apt install libopenblas0-pthread), or a C compiler "
       "(sudo apt install gcc) and run ./scripts/setup.sh again to build the shim to the scipy-openblas32 wheel")


@dataclass(frozen=True)
class BlasChoice:
    """Which BLAS MLX's CPU backend uses in this process."""

    name: str  # "openblas (system)", "openblas (scipy-openblas32 wheel)", "reference", "platform"
    path: str | None
    fast: bool
    why: str  # one line for the log, /health and doctor


_active: BlasChoice | None = None  # owned by activate(): one choice per process


def blas_threads(cores: int, configured: str | None) -> str:
    """OPENBLAS_NUM_THREADS for the engine (pure): what the environment says,
    else half the cores. OpenBLAS's threads spin while they wait for each
    other, and on cores shared with the gateway, the agents or another
    engine they collapse (docs/BENCHMARKS.md, "The CPU path's layouts")."""
    if configured:
        return configured
    return str(max(1, cores // 2))


def shim_path(prefix: str = sys.prefix) -> Path:
    """Where set-up builds the shim: beside the virtualenv's libraries."""
    return Path(prefix) / "lib" / "mlxd" / SHIM_NAME


def _wheel_lib_dir() -> Path | None:
    try:
        import scipy_openblas32
    except ImportError:
        return None
    return Path(scipy_openblas32.get_lib_dir())


def build(cc: str | None = None, target: Path | None = None) -> Path | None:
    """Compile the shim (set-up calls this); None when there is no wheel or
    no compiler, after which the reference BLAS stays (doctor says so)."""
    lib_dir = _wheel_lib_dir()
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if lib_dir is None or cc is None:
        return None
    target = target or shim_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "shim.c"
        source.write_text(SHIM_SOURCE)
        part = Path(tmp) / SHIM_NAME
        proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", str(source), "-o", str(part), f"-L{lib_dir}",
                               "-l:libscipy_openblas.so", f"-Wl,-rpath,{lib_dir}"], capture_output=True, text=True)
        if proc.returncode != 0:
            log.warning("building the BLAS shim failed: %s", proc.stderr.strip()[-500:])
            return None
        os.replace(part, target)  # whole or not at all
    for stale in target.parent.glob(f"{SHIM_STEM}*.so"):  # an older version's (a running engine keeps its copy)
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def _load_global(path: str) -> bool:
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        return hasattr(lib, "cblas_sgemm")
    except OSError:
        return False


def blas_plan(platform: str, opted_out: bool, mlx_loaded: bool, shim: Path | None) -> tuple[list[tuple[str, str]], str]:
    """(the libraries to try, in order, as (name, path); why the reference
    BLAS stays when there are none) (pure)."""
    if not platform.startswith("linux"):
        return [], "not Linux: MLX's own BLAS (Accelerate on macOS)"
    if opted_out:
        return [], f"{OPT_OUT_ENV}=reference"
    if mlx_loaded:
        return [], "mlx was imported before the BLAS could be loaded"
    # The shim first: it also sends a decoded token's one-row products to sgemv.
    plan = [("openblas (scipy-openblas32 wheel)", str(shim))] if shim is not None else []
    plan += [("openblas (system)", name) for name in SYSTEM_OPENBLAS]
    return plan, "no OpenBLAS found"


def activate() -> BlasChoice:
    """Put the fastest BLAS found under MLX, once per process, before
    `mlx.core` is imported; later calls return the first choice."""
    global _active
    if _active is not None:
        return _active
    shim = shim_path()
    plan, why_not = blas_plan(sys.platform, os.environ.get(OPT_OUT_ENV) == "reference", "mlx.core" in sys.modules,
                              shim if shim.is_file() else None)
    if not sys.platform.startswith("linux"):
        _active = BlasChoice("platform", None, True, why_not)
        return _active
    # Read by OpenBLAS when it loads, once per process.
    os.environ["OPENBLAS_NUM_THREADS"] = blas_threads(os.cpu_count() or 1, os.environ.get("OPENBLAS_NUM_THREADS"))
    for name, path in plan:
        if _load_global(path):
            _active = BlasChoice(name, path, True, f"MLX's CPU backend uses {name} ({path}), "
                                 f"{os.environ['OPENBLAS_NUM_THREADS']} thread(s)")
            return _active
    _active = BlasChoice("reference", None, False, f"MLX's CPU backend uses its reference BLAS ({why_not}): "
                         f"prompts are ~15x slower; fix: {FIX}")
    return _active


def active() -> BlasChoice | None:
    """The choice activate() made in this process, if it ran."""
    return _active


def weights_dtype_on_cpu(cpu_float32: bool, stored_dtype: str | None, stored_bytes: int | None, params: int | None,
                         budget_bytes: int) -> str | None:
    """The dtype to load a model's weights in, or None for as stored (pure).
    `cpu_float32`: the engine runs on the CPU with a fast BLAS and the
    config allows it. There float32 is the fastest (quantised matmuls are
    MLX's own kernels, not BLAS), as long as the float32 weights stay small
    -- a quarter of the memory budget at most, so the engine's memory bounds
    hold."""
    if not cpu_float32 or not stored_bytes or not params:
        return None
    if stored_dtype == "float32" or stored_bytes >= params * 4 * 0.95:  # float32 already
        return None
    if params * 4 > budget_bytes // 4:
        return None
    return "float32"


if __name__ == "__main__":  # set-up: python -m mlxd.engine.cpu.fast_blas build
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m mlxd.engine.cpu.fast_blas build")
    if not sys.platform.startswith("linux"):
        sys.exit(0)
    if shim_path().is_file() or build() is not None:
        print("    fast CPU path: OpenBLAS from the scipy-openblas32 wheel (shim built)")
        sys.exit(0)
    system = next((name for name in SYSTEM_OPENBLAS if _load_global(name)), None)
    if system is not None:
        print(f"    fast CPU path: the system's OpenBLAS ({system}); a C compiler (sudo apt install gcc) "
              "and ./scripts/setup.sh again make decoding ~1.3x faster")
    else:
        print(f"    fast CPU path: not available (prompts run ~15x slower on the CPU); fix: {FIX}")
    sys.exit(0)  # not a set-up failure: the reference BLAS still serves
