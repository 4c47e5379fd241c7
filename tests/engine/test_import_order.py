"""The engine chooses MLX's CPU BLAS before MLX loads (engine/cpu/fast_blas.py):
importing the engine's entry point must not import MLX, or the Linux CPU
path silently falls back to the reference BLAS (~15x slower prompts)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_engine_entry_point_leaves_mlx_unloaded():
    probe = "import sys, mlxd.engine.main; print(sorted(m for m in sys.modules if m == 'mlx.core' or m.startswith('mlx_lm')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
