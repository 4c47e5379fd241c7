"""doctor's line for the CPU's BLAS (engine/cpu/fast_blas.py), as a table."""

from __future__ import annotations

import pytest

from mlxd.cli.doctor import blas_check

SLOW = {"name": "reference", "fast": False,
        "why": "MLX's CPU backend uses its reference BLAS (no OpenBLAS found): prompts are ~15x slower; "
               "fix: install OpenBLAS (Debian/Ubuntu: sudo apt install libopenblas0-pthread)"}


@pytest.mark.parametrize("platform, choice, status, fix_has", [
    ("linux", {"name": "openblas (system)", "fast": True, "why": "uses openblas"}, "pass", ""),
    ("linux", SLOW, "warn", "apt install libopenblas0-pthread"),
    ("linux", None, "warn", "./scripts/setup.sh"),
])
def test_the_blas_line(platform, choice, status, fix_has):
    check = blas_check(platform, choice, "no answer")
    assert check is not None and check.status == status and fix_has in check.fix


def test_no_blas_line_off_linux():
    assert blas_check("darwin", {"fast": True}) is None
