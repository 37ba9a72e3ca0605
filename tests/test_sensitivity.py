"""Multi-participation sensitivity: the DP bound never undercuts brute force; the exact cases are exact."""

import math

import numpy as np
import pytest

from dp_adam_bench.privacy.bandmf import BandedToeplitzStrategy
from dp_adam_bench.privacy.sensitivity import (
    brute_force_sensitivity,
    dp_sensitivity_bound,
    participation_patterns,
    strategy_sensitivity,
    toeplitz_sensitivity,
)
from dp_adam_bench.privacy.strategies import DenseStrategy, IdentityStrategy, sqrt_prefix_strategy


def test_participation_patterns_are_all_valid_separated_subsets():
    for n, k, sep in [(6, 2, 2), (7, 3, 2), (5, 3, 3), (4, 1, 1)]:
        pats = list(participation_patterns(n, k, sep))
        assert len(pats) == len(set(pats))
        assert all(
            1 <= len(p) <= k and all(b - a >= sep for a, b in zip(p, p[1:], strict=False)) for p in pats
        )
        expected = sum(
            math.comb(n - (m - 1) * (sep - 1), m) for m in range(1, k + 1) if n - (m - 1) * (sep - 1) >= m
        )
        assert len(pats) == expected


@pytest.mark.parametrize("nonneg", [True, False])
def test_dp_bound_never_below_brute_force(nonneg):
    rng = np.random.default_rng(1 if nonneg else 2)
    for _ in range(60):
        n, k, sep = int(rng.integers(2, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
        c = np.tril(rng.standard_normal((n, n)))
        if nonneg:
            c = np.abs(c)
        assert dp_sensitivity_bound(c, k, sep) >= brute_force_sensitivity(c, k, sep) - 1e-12


def test_dp_bound_exact_for_diagonal_and_one_participation():
    c = np.diag([1.0, 0.5, 0.9, 0.2, 0.8])
    # k participations of a diagonal C: the k largest separated squared diagonal entries
    assert dp_sensitivity_bound(c, 2, 2) == pytest.approx(math.sqrt(0.81 + 1.0))
    rng = np.random.default_rng(3)
    m = np.tril(rng.standard_normal((7, 7)))
    assert dp_sensitivity_bound(m, 1, 1) == pytest.approx(np.sqrt(np.max(np.sum(m**2, axis=0))))


def test_banded_with_bands_at_most_min_sep_is_sqrt_k_and_exact():
    n, b, k = 14, 3, 3
    strat = BandedToeplitzStrategy(n, coefs=np.array([1.0, 0.6, 0.3]))
    for sep in (3, 4):
        sens = strat.sensitivity(participations=k, min_separation=sep)
        assert sens == pytest.approx(math.sqrt(k) * strat.max_column_norm(), rel=1e-12)
        assert sens == pytest.approx(brute_force_sensitivity(strat.matrix(), k, sep), rel=1e-12)
        assert dp_sensitivity_bound(strat.matrix(), k, sep) == pytest.approx(sens, rel=1e-12)
    # with bands > min separation the columns overlap and sqrt(k) is no longer the answer
    overlapping = brute_force_sensitivity(strat.matrix(), k, b - 1)
    assert overlapping > math.sqrt(k) * strat.max_column_norm() + 1e-6
    assert strat.sensitivity(k, b - 1) >= overlapping - 1e-12


@pytest.mark.parametrize("n", [6, 8, 10])
def test_sqrt_strategy_equals_brute_force(n):
    strat = sqrt_prefix_strategy(n)
    c = strat.matrix()
    assert np.all(c.T @ c >= 0)
    for k in (1, 2, 3):
        for sep in (1, 2, 3):
            exact = brute_force_sensitivity(c, k, sep)
            assert strategy_sensitivity(strat, k, sep) == pytest.approx(exact, rel=1e-12)
            bound = dp_sensitivity_bound(c, k, sep)
            assert bound >= exact - 1e-12
            if k <= 2:  # rows of the worst pair agree on their partner: the DP bound is tight here
                assert bound == pytest.approx(exact, rel=1e-12)


def test_identity_and_k1_cases():
    assert IdentityStrategy(30).sensitivity(participations=3, min_separation=10) == pytest.approx(
        math.sqrt(3)
    )
    # only 2 patterns of separation 20 fit into 30 steps
    assert IdentityStrategy(30).sensitivity(participations=3, min_separation=20) == pytest.approx(
        math.sqrt(2)
    )
    assert sqrt_prefix_strategy(12).sensitivity() == pytest.approx(1.0)


def test_general_dense_strategy_uses_a_valid_bound():
    rng = np.random.default_rng(5)
    c = np.tril(rng.uniform(0.1, 1.0, size=(8, 8)))
    strat = DenseStrategy(c)
    for k, sep in [(2, 1), (3, 2)]:
        assert strat.sensitivity(k, sep) >= brute_force_sensitivity(strat.matrix(), k, sep) - 1e-12


def test_toeplitz_sensitivity_rejects_non_monotone_coefficients():
    with pytest.raises(ValueError, match="non-increasing"):
        toeplitz_sensitivity(np.array([1.0, 0.2, 0.5]), 6, 2, 2)
    with pytest.raises(ValueError, match="participations"):
        strategy_sensitivity(IdentityStrategy(4), participations=0)
