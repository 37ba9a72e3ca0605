"""L2 sensitivity of a DP-MF strategy x -> C x under multiple participations.

One example contributes a clipped gradient (norm <= 1) at each step of a *participation pattern*
pi = (i_1 < ... < i_m), m <= k, with consecutive steps at least ``min_separation`` apart (Choquette-Choo et
al. 2022, "Multi-epoch matrix factorization mechanisms for private machine learning"; Choquette-Choo et al.
2024, "(Amplified) banded matrix factorization: a unified approach to private training"). Neighbouring streams
differ by G_pi = sum_{i in pi} e_i g_i^T, so with X = C^T C

    sens(C)^2 = max_pi max_{||g_i|| <= 1} sum_{i, j in pi} X_ij <g_i, g_j>.

* If X >= 0 entrywise the inner maximum is attained with all g_i equal (<g_i, g_j> <= 1; Choquette-Choo et al.
  2022) and sens^2 = max_pi sum_{i, j in pi} X_ij. Otherwise replacing X by |X| gives a valid upper bound.
* k = 1: sens = max column norm of C (the strategies' unit normalisation).
* Banded C with ``bands <= min_separation``: the columns of a pattern have disjoint supports, so
  sens^2 = max_pi sum_{i in pi} ||C e_i||^2, i.e. sqrt(k) * max column norm whenever k max-norm columns fit
  (Choquette-Choo et al. 2024, arXiv:2306.08153).
* Lower-triangular Toeplitz C with non-negative, non-increasing coefficients: X_ij = sum_{m <= n-1-max(i,j)}
  c_m c_{m+|i-j|}. Mapping a pattern p to the earliest one, q_l = l * s, shrinks every index and every gap;
  each X entry only gains non-negative terms and each product c_m c_{m+d} only grows as d shrinks. So (0, s,
  2s, ...) is a worst case and the sensitivity is exact (the argument Dvijotham et al. 2024, "Efficient and
  near-optimal noise generation for streaming differential privacy", make for BLTs).
* Anything else: :func:`dp_sensitivity_bound`, an O(n^2 k) dynamic program giving an upper bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from dp_adam_bench.privacy.toeplitz import first_column_if_toeplitz, nonneg_nonincreasing


class StrategyLike(Protocol):
    """What the sensitivity needs of a strategy (:class:`dp_adam_bench.privacy.strategies.Strategy`)."""

    n: int

    def matrix(self) -> np.ndarray: ...

    def max_column_norm(self) -> float: ...


def _check_args(n: int, participations: int, min_separation: int | None) -> tuple[int, int]:
    k = int(participations)
    if k < 1:
        raise ValueError(f"participations must be >= 1, got {participations!r}")
    sep = 1 if min_separation is None else int(min_separation)
    if sep < 1:
        raise ValueError(f"min_separation must be >= 1 (or None for any pattern), got {min_separation!r}")
    return k, sep


def participation_patterns(n: int, k: int, min_sep: int | None = 1) -> Iterator[tuple[int, ...]]:
    """All participation patterns of an example: index tuples i_1 < ... < i_m in [0, n), 1 <= m <= k, with
    i_{j+1} - i_j >= min_sep. Exponential in k; for brute-force checks on small n only."""
    k, sep = _check_args(n, k, min_sep)

    def extend(prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        yield prefix
        if len(prefix) < k:
            for nxt in range(prefix[-1] + sep, n):
                yield from extend(prefix + (nxt,))

    for first in range(n):
        yield from extend((first,))


def brute_force_sensitivity(c_matrix: np.ndarray, k: int, min_sep: int | None = 1) -> float:
    """Sensitivity by enumerating every pattern (small n only).

    For each pattern maximises s^T X_pipi s over sign vectors s in {-1, 1}^m: exact for scalar gradients, and
    equal to max_pi sum X_pipi (the exact vector-valued sensitivity) whenever X = C^T C >= 0. For X with
    negative entries and vector gradients it is a lower bound (the exact value is a small SDP per pattern).
    """
    c = np.asarray(c_matrix, dtype=np.float64)
    x = c.T @ c
    n = x.shape[0]
    best = 0.0
    for pi in participation_patterns(n, k, min_sep):
        sub = x[np.ix_(pi, pi)]
        m = len(pi)
        if np.all(sub >= 0):
            val = float(sub.sum())
        else:
            # s and -s give the same value: fix the first sign
            signs = np.array([(1,) + rest for rest in itertools.product((-1.0, 1.0), repeat=m - 1)])
            val = float(np.max(np.einsum("si,ij,sj->s", signs, sub, signs)))
        best = max(best, val)
    return float(np.sqrt(best))


def _best_separated_sums(values: np.ndarray, k: int, sep: int) -> np.ndarray:
    """F[m, r] = max sum of at most m entries of values[r, :] whose indices are >= sep apart, m = 0..k.
    ``values`` must be non-negative. Vectorised over rows r; keeps the full history (O(k * cols * rows)
    memory), so it is meant for few rows."""
    rows, cols = values.shape
    # hist[m][p] = best over positions <= p with at most m picks; position -1 (all zeros) is the start value
    best = np.zeros((k + 1, rows))
    hist = np.zeros((k + 1, cols + 1, rows))
    for p in range(cols):
        prev = hist[:, p + 1 - sep] if p + 1 - sep >= 0 else np.zeros((k + 1, rows))
        take = prev[:-1] + values[:, p]
        best[1:] = np.maximum(best[1:], take)
        hist[:, p + 1] = best
    return best


def _separated_prefix_tables(v: np.ndarray, k: int, sep: int) -> tuple[np.ndarray, np.ndarray]:
    """For every row i of the non-negative matrix v: left[m, i] = best sum of at most m separated entries of
    v[i, :i-sep+1] and right[m, i] the same over v[i, i+sep:], m = 0..k-1.

    One pass over positions for all rows at once; keeps a ring of the last ``sep`` DP states (O(k * sep * n)
    memory) instead of the full history."""
    n = v.shape[0]
    km = k - 1
    left = np.zeros((km + 1, n))
    right = np.zeros((km + 1, n))
    if km == 0:
        return left, right

    def sweep(vals: np.ndarray, out: np.ndarray) -> None:
        # vals[i, p]: value of picking position p for row i (positions scanned left to right);
        # out[:, i] = state after position i - sep, i.e. only positions <= i - sep were eligible.
        ring = np.zeros((sep, km + 1, n))
        state = np.zeros((km + 1, n))
        for p in range(n):
            before = ring[p % sep] if p >= sep else np.zeros((km + 1, n))
            take = before[:-1] + vals[:, p]
            state = state.copy()
            state[1:] = np.maximum(state[1:], take)
            ring[p % sep] = state
            i = p + sep
            if i < n:
                out[:, i] = state[:, i]

    sweep(v, left)
    flipped = v[::-1, ::-1]
    right_flipped = np.zeros_like(right)
    sweep(flipped, right_flipped)
    right[:] = right_flipped[:, ::-1]
    return left, right


def _best_pattern_sum(weights: np.ndarray, k: int, sep: int) -> float:
    """max over patterns (at most k indices, >= sep apart) of sum_{i in pi} weights[i], weights >= 0."""
    return float(_best_separated_sums(np.asarray(weights, dtype=np.float64)[None, :], k, sep)[k, 0])


def dp_sensitivity_bound(c_matrix: np.ndarray, k: int, min_sep: int | None = 1) -> float:
    """Upper bound on the k-participation sensitivity by a dynamic program: O(n^2 k) after forming C^T C.

    With Y = |C^T C| and r_i = max over patterns pi containing i of sum_{j in pi} Y_ij (a left and a right
    separated-subset DP per row), every pattern satisfies sum_{i,j in pi} Y_ij = sum_{i in pi} sum_{j in pi}
    Y_ij <= sum_{i in pi} r_i, so sens^2 <= max_pi sum_{i in pi} r_i (one more 1-D DP). Tight when one pattern
    attains every r_i of the final argmax pattern at once, e.g. diagonal X (k independent copies), X with
    disjoint-support columns (banded, bands <= min_sep), or X constant on the patterns; looser when the rows
    of the worst pattern prefer different partners. For X with negative entries it also pays for |X|.
    """
    c = np.asarray(c_matrix, dtype=np.float64)
    k, sep = _check_args(c.shape[0], k, min_sep)
    y = np.abs(c.T @ c)
    diag = np.diag(y).copy()
    if k == 1:
        return float(np.sqrt(diag.max()))
    left, right = _separated_prefix_tables(y, k, sep)
    # split k-1 extra picks between the left and the right part
    extra = np.full(y.shape[0], -np.inf)
    for a in range(k):
        extra = np.maximum(extra, left[a] + right[k - 1 - a])
    row_best = diag + extra
    return float(np.sqrt(_best_pattern_sum(row_best, k, sep)))


def toeplitz_sensitivity(coefs: np.ndarray, n: int, k: int, min_sep: int | None = 1) -> float:
    """Exact sensitivity of the n x n lower-triangular Toeplitz C with non-negative, non-increasing
    coefficients: the earliest pattern (0, s, 2s, ...) is a worst case (see the module docstring)."""
    k, sep = _check_args(n, k, min_sep)
    c = np.zeros(n)
    m = min(n, len(coefs))
    c[:m] = np.asarray(coefs, dtype=np.float64)[:m]
    if not nonneg_nonincreasing(c):
        raise ValueError("toeplitz_sensitivity needs non-negative, non-increasing coefficients")
    pattern = np.arange(0, n, sep)[:k]
    total = 0.0
    for a in pattern:
        for b in pattern:
            lo, hi = min(a, b), max(a, b)
            d = hi - lo
            total += float(np.dot(c[: n - hi], c[d : d + n - hi]))
    return float(np.sqrt(total))


def strategy_sensitivity(
    strategy: StrategyLike, participations: int = 1, min_separation: int | None = None
) -> float:
    """L2 sensitivity of x -> C x when an example participates ``participations`` times at least
    ``min_separation`` steps apart (None: any pattern, i.e. separation 1). Exact for k = 1, for banded
    strategies with bands <= min_separation, and for Toeplitz strategies with non-negative non-increasing
    coefficients; otherwise the upper bound of :func:`dp_sensitivity_bound` (a valid sensitivity for
    accounting)."""
    k, sep = _check_args(strategy.n, participations, min_separation)
    if k == 1:
        return strategy.max_column_norm()
    bands = getattr(strategy, "bands", None)
    if bands is not None and int(bands) <= sep:
        col_norm_sq = np.sum(strategy.matrix() ** 2, axis=0)
        return float(np.sqrt(_best_pattern_sum(col_norm_sq, k, sep)))
    c = strategy.matrix()
    col = first_column_if_toeplitz(c)
    if col is not None and nonneg_nonincreasing(col):
        return toeplitz_sensitivity(col, strategy.n, k, sep)
    return dp_sensitivity_bound(c, k, sep)
