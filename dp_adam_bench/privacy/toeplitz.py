"""Lower-triangular Toeplitz matrices as power series: pure functions on their coefficients.

A lower-triangular Toeplitz C with first column c_0, c_1, ... is the power series c(x) = sum_k c_k x^k
truncated at x^n; products and inverses of such matrices are products and inverses of the series (the view
McKenna 2024, "Scaling up the banded matrix factorization mechanism for differentially private ML",
arXiv:2405.15913, and Dvijotham et al. 2024, "Efficient and near-optimal noise generation for streaming
differential privacy", arXiv:2404.16706, take of streaming strategies). The prefix-sum workload A is the series
1 / (1 - x), and its square root C = A^{1/2} (Fichtenberger, Henzinger & Upadhyay 2023, arXiv:2202.11205;
the "DP-MF optimised for single-epoch prefix sums" of Ganesh et al.) has coefficients of (1 - x)^{-1/2}, its
inverse those of (1 - x)^{1/2}.

Imported by :mod:`.strategies`, :mod:`.sensitivity`, :mod:`.bandmf`; imports nothing from the package.
"""

from __future__ import annotations

import numpy as np
from scipy.signal import lfilter


def prefix_workload(n: int) -> np.ndarray:
    """A: the n x n all-ones lower-triangular prefix-sum matrix (the series 1 / (1 - x))."""
    return np.tril(np.ones((n, n)))


def toeplitz_lower(coefs: np.ndarray, n: int | None = None) -> np.ndarray:
    """Lower-triangular Toeplitz matrix whose k-th subdiagonal is ``coefs[k]`` (zero beyond len(coefs))."""
    n = len(coefs) if n is None else n
    c = np.zeros(n)
    m = min(n, len(coefs))
    c[:m] = coefs[:m]
    idx = np.arange(n)
    diff = idx[:, None] - idx[None, :]
    return np.where(diff >= 0, c[np.clip(diff, 0, n - 1)], 0.0)


def sqrt_prefix_coefficients(n: int) -> np.ndarray:
    """Coefficients of (1 - x)^{-1/2}: 1, 1/2, 3/8, 5/16, ... (so that Toeplitz(c)^2 = A)."""
    c = np.empty(n)
    c[0] = 1.0
    for k in range(1, n):
        c[k] = c[k - 1] * (2 * k - 1) / (2 * k)
    return c


def sqrt_prefix_inverse_coefficients(n: int) -> np.ndarray:
    """Coefficients of (1 - x)^{1/2}: 1, -1/2, -1/8, -1/16, ... (the inverse series of
    :func:`sqrt_prefix_coefficients`)."""
    e = np.empty(n)
    e[0] = 1.0
    for k in range(1, n):
        e[k] = e[k - 1] * (k - 1.5) / k
    return e


def inverse_series(coefs: np.ndarray, n: int) -> np.ndarray:
    """First n coefficients of 1 / c(x): the Toeplitz coefficients of C^{-1} (C lower-triangular Toeplitz,
    c_0 != 0), by running the recursion c * e = 1 as an IIR filter on an impulse."""
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return lfilter([1.0], np.asarray(coefs, dtype=np.float64), impulse)


def first_column_if_toeplitz(c: np.ndarray) -> np.ndarray | None:
    """The coefficients if the square matrix c is lower-triangular Toeplitz, else None."""
    col = c[:, 0]
    n = c.shape[0]
    # compare a few diagonals cheaply before the full check
    if not np.allclose(np.diag(c), col[0]):
        return None
    if n > 1 and not np.allclose(np.diag(c, -1), col[1]):
        return None
    if not np.allclose(c, toeplitz_lower(col), rtol=1e-10, atol=1e-13):
        return None
    return col


def nonneg_nonincreasing(c: np.ndarray) -> bool:
    """True when the coefficients are >= 0 and non-increasing (up to 1e-12 relative)."""
    tol = 1e-12 * float(np.max(np.abs(c)))
    return bool(np.all(c >= -tol) and np.all(np.diff(c) <= tol))
