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


@pytest.mark.parametrize("variant_name", ["adam", "adambc", "bc"])
@pytest.mark.parametrize("kind", ["bandmf", "dpmf_sqrt", "independent"])
def test_online_phi_of_the_optimizer_equals_adam_phi(variant_name, kind):
    """optim/adam.py keeps Phi_t online in state["phi"]; adam_phi computes it from the variance sequence."""
    import torch

    from dp_adam_bench.optim.adam import Adam, AdamBC, BiasCorrection
    from dp_adam_bench.optim.base import StepContext
    from dp_adam_bench.privacy.adam_bias import adam_phi

    n, beta2, sigma, clip, batch = 60, 0.95, 1.3, 0.7, 16.0
    if kind == "bandmf":
        row_var = BandedToeplitzStrategy(n, 8).row_variance()
    elif kind == "dpmf_sqrt":
        row_var = sqrt_prefix_strategy(n).row_variance()
    else:
        row_var = np.ones(n)
    variances = (sigma * clip / batch) ** 2 * row_var
    cls = {"adam": Adam, "adambc": AdamBC, "bc": BiasCorrection}[variant_name]
    variant = cls(lr=1e-3, beta2=beta2)
    params = [torch.zeros(3, dtype=torch.float64)]
    state = variant.init(params)
    online = []
    for t, var in enumerate(variances.tolist(), start=1):
        grad = [torch.full((3,), 0.1 * t, dtype=torch.float64)]
        ctx = StepContext(
            step=t,
            noisy=grad,
            noise_std=sigma * clip / batch,
            noise_variance=var,
            sigma=sigma,
            clip=clip,
            expected_batch_size=batch,
        )
        variant.update(params, state, ctx)
        online.append(state["phi"])
    expected = adam_phi(variances, beta2)
    np.testing.assert_allclose(online, expected, rtol=1e-12, atol=0)
    # ... and adam_v_bias is the same function per unit (sigma clip / B)^2
    np.testing.assert_allclose(
        adam_v_bias(row_var, beta2) * (sigma * clip / batch) ** 2, expected, rtol=1e-12
    )


def test_adam_phi_rejects_bad_variances():
    from dp_adam_bench.privacy.adam_bias import adam_phi

    with pytest.raises(ValueError, match="variances"):
        adam_phi([1.0, float("nan")], 0.9)
    with pytest.raises(ValueError, match="variances"):
        adam_phi([-1.0], 0.9)
