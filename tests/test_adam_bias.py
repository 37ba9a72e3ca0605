"""Bias of Adam's v^ under DP-MF noise (Ganesh App. A): corrected recursion = closed form = Monte Carlo."""

import numpy as np
import pytest

from dp_adam_bench.privacy.adam_bias import adam_v_bias, adam_v_bias_as_printed, adam_v_bias_closed_form
from dp_adam_bench.privacy.bandmf import BandedToeplitzStrategy
from dp_adam_bench.privacy.strategies import sqrt_prefix_strategy


@pytest.mark.parametrize("beta2", [0.5, 0.9, 0.999])
def test_recursion_equals_closed_form_on_random_lower_triangular(beta2):
    rng = np.random.default_rng(0)
    c_inv = np.tril(rng.standard_normal((30, 30)))
    row_var = np.sum(c_inv**2, axis=1)
    np.testing.assert_allclose(adam_v_bias(row_var, beta2), adam_v_bias_closed_form(c_inv, beta2), rtol=1e-12)


@pytest.mark.parametrize("beta2", [0.0, 0.9, 0.999])
def test_independent_noise_has_bias_exactly_one(beta2):
    np.testing.assert_allclose(adam_v_bias(np.ones(200), beta2), 1.0, rtol=1e-12)
    np.testing.assert_allclose(adam_v_bias_closed_form(np.eye(40), beta2), 1.0, rtol=1e-12)


def test_printed_recursion_differs_from_closed_form():
    # identity: only the extra beta2 factor differs, so the printed recursion gives beta2 instead of 1
    np.testing.assert_allclose(adam_v_bias_as_printed(np.eye(20), 0.9), 0.9, rtol=1e-12)
    # Toeplitz and banded C^{-1}: column norms of the n x n matrix are row norms read backwards (+ the beta2)
    for strat, min_gap in [(sqrt_prefix_strategy(50), 0.14), (BandedToeplitzStrategy(50, 8), 0.25)]:
        c_inv = strat.inverse_matrix()
        closed = adam_v_bias_closed_form(c_inv, 0.9)
        printed = adam_v_bias_as_printed(c_inv, 0.9)
        rel_gap = np.max(np.abs(printed - closed) / closed)
        assert rel_gap > min_gap  # 14.6 % (sqrt), 27.1 % (BandMF b=8) at beta2 = 0.9, n = 50
        # the printed recursion overstates the first steps' bias (column 0 is the longest column)
        assert printed[0] > closed[0] * 1.1
    # a non-Toeplitz C^{-1}
    rng = np.random.default_rng(4)
    c_inv = np.tril(rng.standard_normal((25, 25)))
    closed = adam_v_bias_closed_form(c_inv, 0.99)
    assert np.max(np.abs(adam_v_bias_as_printed(c_inv, 0.99) - closed) / closed) > 0.1


def test_monte_carlo_adam_second_moment_on_pure_correlated_noise():
    n, trials, beta2 = 25, 20000, 0.9
    strat = sqrt_prefix_strategy(n)
    rng = np.random.default_rng(7)
    w = strat.inverse_matrix() @ rng.standard_normal((n, trials))  # zero gradient: g~ = w
    v = np.zeros(trials)
    v_hat = np.empty((n, trials))
    for t in range(n):
        v = beta2 * v + (1 - beta2) * w[t] ** 2
        v_hat[t] = v / (1 - beta2 ** (t + 1))
    expected = adam_v_bias(strat.row_variance(), beta2)
    mean = v_hat.mean(axis=1)
    stderr = v_hat.std(axis=1) / np.sqrt(trials)
    assert np.all(np.abs(mean - expected) < 5 * stderr)
    # ... and the printed recursion is rejected by the same data
    printed = adam_v_bias_as_printed(strat.inverse_matrix(), beta2)
    assert np.any(np.abs(mean - printed) > 10 * stderr)


def test_rejects_bad_beta2():
    with pytest.raises(ValueError, match="beta2"):
        adam_v_bias(np.ones(3), 1.0)
