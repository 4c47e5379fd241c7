"""MLX's float32 products through the BLAS the engine puts under it
(engine/cpu/fast_blas.py): the shim sends one-row products (a decoded token) to
sgemv, every other shape to sgemm. Each form MLX can hand to cblas_sgemm --
either operand transposed, a strided row, a bias folded in (addmm, beta 1),
an output over uninitialised memory (beta 0) -- must equal numpy's answer."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from mlxd.engine.cpu import fast_blas

mx = pytest.importorskip("mlx.core")


def _arrays(seed: int, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


@pytest.mark.parametrize("k, n, a_transposed, b_transposed", [
    (576, 1536, False, False),   # a transposed layer (in x out), as engine/cpu/cpu_linear.py lays them out
    (1536, 576, False, True),    # a stored layer (out x in), as mlx-lm's nn.Linear computes x @ W.T
    (64, 7, True, False),        # the row is a column of a larger matrix (lda > 1)
    (64, 7, True, True),
    (3, 2, False, False),
])
def test_one_row_products_match_numpy(k, n, a_transposed, b_transposed):
    x, w = _arrays(k * n, (1, k), (k, n))
    a = mx.array(np.ascontiguousarray(x.T)).T if a_transposed else mx.array(x)
    b = mx.array(np.ascontiguousarray(w.T)).T if b_transposed else mx.array(w)
    for _ in range(3):  # fresh outputs each time: uninitialised memory must never leak through
        got = np.array(mx.matmul(a, b, stream=mx.cpu))
        np.testing.assert_allclose(got, x @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("b_transposed", [False, True])
def test_a_column_of_a_matrix_as_the_row_matches_numpy(b_transposed):
    m, w = _arrays(3, (96, 8), (96, 40))
    column = mx.array(m)[:, 5:6].T  # 1 x 96 with a stride of 8: lda > 1 if MLX passes it transposed
    b = mx.array(np.ascontiguousarray(w.T)).T if b_transposed else mx.array(w)
    np.testing.assert_allclose(np.array(mx.matmul(column, b, stream=mx.cpu)), m[:, 5:6].T @ w, rtol=1e-4, atol=1e-4)


def test_a_strided_row_of_a_matrix_matches_numpy():
    m, w = _arrays(1, (8, 96), (96, 40))
    row = mx.array(m)[3:4, ::2]  # every other column of one row: MLX copies or passes a stride
    got = np.array(mx.matmul(row, mx.array(w[::2]), stream=mx.cpu))
    np.testing.assert_allclose(got, m[3:4, ::2] @ w[::2], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.5, 2.0), (1.0, 0.0)])
def test_one_row_addmm_keeps_alpha_and_beta(alpha, beta):
    x, w, c = _arrays(2, (1, 200), (200, 300), (1, 300))
    c[0, 5] = np.nan if beta == 0.0 else c[0, 5]  # beta 0 ignores c, NaN included (BLAS's contract)
    got = np.array(mx.addmm(mx.array(c), mx.array(x), mx.array(w), alpha=alpha, beta=beta, stream=mx.cpu))
    want = alpha * (x @ w) + (beta * np.nan_to_num(c) if beta else 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [2, 5])
def test_several_rows_still_take_sgemm(m):
    x, w = _arrays(m, (m, 128), (128, 70))
    np.testing.assert_allclose(np.array(mx.matmul(mx.array(x), mx.array(w), stream=mx.cpu)), x @ w,
                               rtol=1e-4, atol=1e-4)


def test_the_engine_on_linux_uses_the_shim_when_set_up_built_it():
    choice = fast_blas.active()
    assert choice is not None  # tests/conftest.py activates it before MLX loads
    if sys.platform.startswith("linux") and fast_blas.shim_path().is_file():
        assert choice.name == "openblas (scipy-openblas32 wheel)" and choice.path == str(fast_blas.shim_path())
    else:
        assert choice.name != "openblas (scipy-openblas32 wheel)"
