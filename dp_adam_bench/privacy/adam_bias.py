"""Exact bias of Adam's bias-corrected second moment under correlated (DP-MF) noise — Ganesh et al., App. A.

Adam on the privatised gradient g~_t = g_t + (sigma * clip / B) w_t with w = C^{-1} z, z ~ N(0, I), keeps
v_t = beta2 v_{t-1} + (1 - beta2) g~_t^2 and v^_t = v_t / (1 - beta2^t) (1-based t), so per coordinate

    v^_t = g~_{:t}^T D(beta2, t) g~_{:t},
    D(beta2, t) = (1 - beta2) / (1 - beta2^t) * diag(beta2^{t-1}, ..., beta2, 1),

and E[v^_t] - (noise-free v^_t) = Tr((C^{-1}_{:t,:t})^T D(beta2, t) C^{-1}_{:t,:t}) * (sigma clip / B)^2
(Ganesh et al., App. A, the closed form). Everything here is per unit of (sigma * clip / B)^2.

**The printed recursion disagrees with the closed form; the closed form wins.** App. A print

    b_{t+1} = (beta2 - beta2^{t+1}) / (1 - beta2^{t+1}) b_t
              + beta2 (1 - beta2) / (1 - beta2^{t+1}) ((C^{-1})^T C^{-1})_{t+1,t+1},

which has two errors:

(a) ((C^{-1})^T C^{-1})_{jj} is the squared *column* norm of C^{-1}. The trace above expands to
    sum_s D_ss ||row s of C^{-1}||^2, and the variance of w_s = (C^{-1} z)_s is the squared *row* norm
    (C^{-1} C^{-T})_{ss}. For a lower-triangular Toeplitz C^{-1} the column norm of column j of the n x n
    matrix is the row norm of row n - 1 - j, so the printed term even depends on the horizon n.
(b) The extra beta2 in the second term is wrong: from v_{t+1} = beta2 v_t + (1 - beta2) g~_{t+1}^2,
    v^_{t+1} = (beta2 - beta2^{t+1}) / (1 - beta2^{t+1}) v^_t + (1 - beta2) / (1 - beta2^{t+1}) g~_{t+1}^2
    (the same identity Ganesh et al. use in App. B). With the extra beta2, independent noise (C^{-1} = I) gets
    bias beta2 instead of 1 at every step.

(The App. A display of v^_t also weights g_i by beta2^{i-1} instead of beta2^{t-i}; D(beta2, t) itself is
right.) :func:`adam_v_bias` implements the corrected recursion with row variances and equals the closed form;
:func:`adam_v_bias_as_printed` keeps the printed one for comparison (tests quantify the gap).
"""

from __future__ import annotations

import numpy as np


def _check_beta2(beta2: float) -> float:
    beta2 = float(beta2)
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must lie in [0, 1), got {beta2}")
    return beta2


def adam_phi(noise_variance, beta2: float) -> np.ndarray:
    """Phi_t, the exact bias of Adam's v^_t, for t = 1..n (returned 0-based) from the per-step noise variances
    Var_t of one coordinate of the privatized gradient:

        Phi_t = ((beta2 - beta2^t) Phi_{t-1} + (1 - beta2) Var_t) / (1 - beta2^t),   Phi_0 = 0,

    the recursion of v^_t itself (Ganesh et al. App. A, corrected as in the module docstring; Tang & Lecuyer
    2024, arXiv:2312.14334, Eq. 3 for constant Var_t). A pure function, evaluated in the same floating-point
    order as the online update of :class:`dp_adam_bench.optim.adam.Adam` (``state["phi"]``), which
    tests/test_adam_bias.py ties to it step by step."""
    beta2 = _check_beta2(beta2)
    variances = np.asarray(noise_variance, dtype=np.float64).ravel()
    if not np.all(np.isfinite(variances)) or np.any(variances < 0):
        raise ValueError(f"noise variances must be finite and >= 0, got {variances!r}")
    out = np.empty_like(variances)
    phi = 0.0
    for i, var in enumerate(variances.tolist()):
        t = i + 1
        phi = ((beta2 - beta2**t) * phi + (1 - beta2) * var) / (1 - beta2**t)
        out[i] = phi
    return out


def adam_v_bias(row_variance: np.ndarray, beta2: float) -> np.ndarray:
    """Bias of v^_t for t = 1..n (returned 0-based, length n) per unit (sigma clip / B)^2: :func:`adam_phi`
    of r_s = Var((C^{-1} z)_s) = ||row s of C^{-1}||^2 (``Strategy.row_variance()``), i.e. the corrected
    recursion b_{t+1} = (beta2 - beta2^{t+1}) / (1 - beta2^{t+1}) b_t + (1 - beta2) / (1 - beta2^{t+1})
    r_{t+1}, b_0 = 0."""
    return adam_phi(row_variance, beta2)


def adam_v_bias_closed_form(c_inverse: np.ndarray, beta2: float) -> np.ndarray:
    """Tr((C^{-1}_{:t,:t})^T D(beta2, t) C^{-1}_{:t,:t}) for t = 1..n (Ganesh et al., App. A), directly from
    the matrix, O(n^3) in all: a reference for checks; :func:`adam_v_bias` is the O(n) way."""
    beta2 = _check_beta2(beta2)
    ci = np.asarray(c_inverse, dtype=np.float64)
    if ci.ndim != 2 or ci.shape[0] != ci.shape[1]:
        raise ValueError(f"C^-1 must be square, got shape {ci.shape}")
    n = ci.shape[0]
    out = np.empty(n)
    for t in range(1, n + 1):
        block = ci[:t, :t]
        weights = (1.0 - beta2) / (1.0 - beta2**t) * beta2 ** np.arange(t - 1, -1, -1)
        out[t - 1] = float(np.einsum("s,su,su->", weights, block, block))  # Tr(block^T diag(w) block)
    return out


def adam_v_bias_as_printed(c_inverse: np.ndarray, beta2: float) -> np.ndarray:
    """The recursion exactly as printed in Ganesh et al. App. A (squared column norms of the full C^{-1},
    extra beta2 factor). Kept only to document how far it is from :func:`adam_v_bias_closed_form`; do not use
    it for bias correction."""
    beta2 = _check_beta2(beta2)
    ci = np.asarray(c_inverse, dtype=np.float64)
    col_sq = np.sum(ci**2, axis=0)
    out = np.empty(len(col_sq))
    b = 0.0
    for i, val in enumerate(col_sq):
        t1 = i + 1
        denom = 1.0 - beta2**t1
        b = (beta2 - beta2**t1) / denom * b + beta2 * (1.0 - beta2) / denom * val
        out[i] = b
    return out
