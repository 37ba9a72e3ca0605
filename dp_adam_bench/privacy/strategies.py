"""Noise-correlating strategies for DP matrix factorization (DP-MF).

A strategy is the lower-triangular factor C of the prefix-sum workload A = B C (Ganesh et al. §2, Algorithm 1).
The private algorithm releases C x + z and post-processes with B = A C^{-1}, which is the same as adding the
correlated noise w = C^{-1} z to the per-step gradients. C^{-1} = I is DP-SGD.

Conventions (every strategy here follows them):

* Strategies are normalised to **unit max column norm** of C, so a single participation has L2 sensitivity 1 and
  the noise multiplier sigma keeps its DP-SGD meaning.
* ``row_variance()[t]`` is the per-coordinate variance of w_t = (C^{-1} z)_t for z ~ N(0, I): the squared norm of
  row t of C^{-1}. This is what bias correction subtracts (Ganesh App. A).
* ``prefix_rmse()`` is the RMSE of the noisy prefix sums, sqrt(mean_t ||(A C^{-1})_t||^2), per unit of noise
  multiplier and per unit of the clipped per-step sum (multiply by sigma / B for averaged gradients).

Small value objects in the spirit of jax_privacy's ``matrix_factorization`` strategies; written here because no
PyTorch library ships correlated-noise strategies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property

import numpy as np

from dp_adam_bench.privacy import sensitivity as _sensitivity
from dp_adam_bench.privacy.toeplitz import (
    prefix_workload,
    sqrt_prefix_coefficients,
    sqrt_prefix_inverse_coefficients,
    toeplitz_lower,
)

__all__ = [
    "DenseStrategy",
    "IdentityStrategy",
    "SqrtPrefixStrategy",
    "Strategy",
    "ToeplitzStrategy",
    "prefix_workload",
    "sqrt_prefix_coefficients",
    "sqrt_prefix_strategy",
    "toeplitz_lower",
]


def check_n(n: int) -> int:
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"number of steps n must be a positive integer, got {n!r}")
    return int(n)


class Strategy(ABC):
    """A lower-triangular strategy C (n x n) with unit max column norm; see the module docstring."""

    name: str = "strategy"

    def __init__(self, n: int):
        self.n = check_n(n)

    # --- the matrices (dense; fine for n up to a few thousand) -----------------------------------------------
    @abstractmethod
    def matrix(self) -> np.ndarray:
        """C, n x n, lower triangular, unit max column norm."""

    def inverse_matrix(self) -> np.ndarray:
        """C^{-1}, the noise-correlating matrix applied to i.i.d. Gaussian noise."""
        from scipy.linalg import solve_triangular

        return solve_triangular(self.matrix(), np.eye(self.n), lower=True)

    # --- what researchers ask of a strategy ---------------------------------------------------------------------
    @cached_property
    def _row_variance(self) -> np.ndarray:
        return np.sum(self.inverse_matrix() ** 2, axis=1)

    def row_variance(self) -> np.ndarray:
        """Per-coordinate variance of w_t = (C^{-1} z)_t for unit-variance z, t = 0..n-1."""
        return self._row_variance

    def max_column_norm(self) -> float:
        return float(np.sqrt(np.max(np.sum(self.matrix() ** 2, axis=0))))

    def prefix_rmse(self) -> float:
        """sqrt(mean_t ||(A C^{-1})_t||^2): RMSE of the prefix sums per unit noise multiplier (single participation)."""
        err = np.cumsum(self.inverse_matrix(), axis=0)  # A @ C^{-1}
        return float(np.sqrt(np.mean(np.sum(err**2, axis=1))))

    def sensitivity(self, participations: int = 1, min_separation: int | None = None) -> float:
        """L2 sensitivity of x -> C x when one example participates ``participations`` times, ``min_separation``
        steps apart at least (:func:`dp_adam_bench.privacy.sensitivity.strategy_sensitivity`)."""
        return _sensitivity.strategy_sensitivity(
            self, participations=participations, min_separation=min_separation
        )

    def mechanism(self):
        """The streaming noise mechanism generating w = C^{-1} z for this strategy."""
        from dp_adam_bench.privacy.mechanisms import DenseMechanism

        return DenseMechanism(self.inverse_matrix(), name=self.name)

    def describe(self) -> dict:
        return {"name": self.name, "n": self.n}


class ToeplitzStrategy(Strategy):
    """A lower-triangular Toeplitz C, given by its first column ``coefs`` (C^{-1} is Toeplitz too, first column
    ``inverse_coefficients()``): every quantity has an O(n) formula instead of an n x n matrix."""

    coefs: np.ndarray

    def inverse_coefficients(self) -> np.ndarray:
        raise NotImplementedError

    def matrix(self) -> np.ndarray:
        return toeplitz_lower(self.coefs, self.n)

    def inverse_matrix(self) -> np.ndarray:
        return toeplitz_lower(self.inverse_coefficients(), self.n)

    def row_variance(self) -> np.ndarray:
        return np.cumsum(self.inverse_coefficients() ** 2)

    def max_column_norm(self) -> float:
        return float(np.linalg.norm(self.coefs[: self.n]))  # column 0 is the longest

    def prefix_rmse(self) -> float:
        f = np.cumsum(self.inverse_coefficients())  # first column of A C^{-1}
        return float(np.sqrt(np.mean(np.cumsum(f**2))))


class IdentityStrategy(Strategy):
    """C = I: independent noise, i.e. DP-SGD."""

    name = "independent"

    def matrix(self) -> np.ndarray:
        return np.eye(self.n)

    def inverse_matrix(self) -> np.ndarray:
        return np.eye(self.n)

    def row_variance(self) -> np.ndarray:
        return np.ones(self.n)

    def max_column_norm(self) -> float:
        return 1.0

    def prefix_rmse(self) -> float:
        # ||row t of A||^2 = t + 1
        return float(np.sqrt(np.mean(np.arange(1, self.n + 1))))

    def mechanism(self):
        from dp_adam_bench.privacy.mechanisms import IndependentMechanism

        return IndependentMechanism()


class DenseStrategy(Strategy):
    """Any dense lower-triangular C (given directly or through C^{-1}), rescaled to unit max column norm."""

    name = "dense"

    def __init__(
        self, c_matrix: np.ndarray | None = None, *, c_inverse: np.ndarray | None = None, name: str = "dense"
    ):
        if (c_matrix is None) == (c_inverse is None):
            raise ValueError("give exactly one of c_matrix or c_inverse")
        from scipy.linalg import solve_triangular

        given = np.asarray(c_matrix if c_matrix is not None else c_inverse, dtype=np.float64)
        if given.ndim != 2 or given.shape[0] != given.shape[1]:
            raise ValueError(f"strategy matrix must be square, got shape {given.shape}")
        if not np.allclose(given, np.tril(given)):
            raise ValueError(
                "strategy matrix must be lower triangular (noise at step t may only use z_1..z_t)"
            )
        if np.any(np.abs(np.diag(given)) < 1e-12):
            raise ValueError("strategy matrix must have a non-zero diagonal (it must be invertible)")
        super().__init__(given.shape[0])
        n = given.shape[0]
        c = given if c_matrix is not None else solve_triangular(given, np.eye(n), lower=True)
        scale = np.sqrt(np.max(np.sum(c**2, axis=0)))
        self._c = c / scale
        self._c_inv = solve_triangular(self._c, np.eye(n), lower=True)
        self.name = name

    def matrix(self) -> np.ndarray:
        return self._c

    def inverse_matrix(self) -> np.ndarray:
        return self._c_inv


class SqrtPrefixStrategy(ToeplitzStrategy):
    """The optimal single-epoch prefix-sum factorization C = A^{1/2}: Toeplitz coefficients of (1 - x)^{-1/2},
    normalised to unit max column norm; C^{-1} is Toeplitz with the coefficients of (1 - x)^{1/2} times the
    norm (Fichtenberger, Henzinger & Upadhyay 2023, arXiv:2202.11205; Ganesh §5.1's "DP-MF optimized for
    single-epoch prefix sums"). Its noise stream is the dense one (every past z), as before."""

    name = "dpmf_sqrt"

    def __init__(self, n: int):
        super().__init__(n)
        raw = sqrt_prefix_coefficients(self.n)
        self.scale = float(np.linalg.norm(raw))
        self.coefs = raw / self.scale
        self._inv_coefs = self.scale * sqrt_prefix_inverse_coefficients(self.n)

    def inverse_coefficients(self) -> np.ndarray:
        return self._inv_coefs


def sqrt_prefix_strategy(n: int) -> SqrtPrefixStrategy:
    """:class:`SqrtPrefixStrategy` over n steps."""
    return SqrtPrefixStrategy(check_n(n))
