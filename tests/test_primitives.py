"""The lecture's mechanisms (Karimireddy, CSCI 699 week 3): closed forms, hand examples and Monte-Carlo checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import gaussian_mechanism as dpa_gaussian

from dp_adam_bench.privacy.accounting import gaussian_delta
from dp_adam_bench.privacy.primitives import (
    advanced_composition,
    basic_composition,
    clip_rows,
    gaussian_mechanism,
    gaussian_sigma_analytic,
    gaussian_sigma_classic,
    laplace_mechanism,
    poisson_amplification,
    private_mean,
    private_mean_sensitivity,
    private_mean_sigma,
)

DELTA = 1e-5


def test_laplace_empirical_std_matches_scale():
    rng = np.random.default_rng(0)
    n, sens, eps = 200_000, 2.0, 0.5
    out = laplace_mechanism(np.full(n, 3.0), sens, eps, rng)
    b = sens / eps
    # Laplace(b) has std b sqrt(2); the sample std has relative MC error ~ 1/sqrt(n) (x ~1.2 for the tails)
    assert out.mean() == pytest.approx(3.0, abs=5 * b * math.sqrt(2 / n))
    assert out.std() == pytest.approx(b * math.sqrt(2), rel=0.01)
    assert isinstance(laplace_mechanism(1.0, 1.0, 1.0, rng), float)


def test_gaussian_empirical_std_matches_sigma():
    rng = np.random.default_rng(1)
    n, sigma = 200_000, 3.0
    out = gaussian_mechanism(np.zeros((n, 2)), sigma, rng)
    assert out.shape == (n, 2)
    assert out.std() == pytest.approx(sigma, rel=0.01)
    assert abs(out.mean()) < 5 * sigma / math.sqrt(2 * n)


def test_classic_sigma_formula_and_range():
    assert gaussian_sigma_classic(2.0, 0.5, DELTA) == pytest.approx(
        2.0 * math.sqrt(2 * math.log(1.25 / DELTA)) / 0.5
    )
    with pytest.raises(ValueError, match=r"epsilon in \(0, 1\), got 2\.0"):
        gaussian_sigma_classic(1.0, 2.0, DELTA)
    with pytest.warns(UserWarning, match="2.0"):
        gaussian_sigma_classic(1.0, 2.0, DELTA, strict=False)


@pytest.mark.parametrize("eps", [0.1, 0.5, 0.9, 2.0, 8.0])
def test_analytic_sigma_vs_dp_accounting_and_classic(eps):
    sigma = gaussian_sigma_analytic(1.0, eps, DELTA)
    assert sigma == pytest.approx(dpa_gaussian.get_sigma_gaussian(eps, DELTA), rel=1e-8)
    assert gaussian_delta(eps, 1.0 / sigma) == pytest.approx(DELTA, rel=1e-8)  # exactly calibrated
    assert gaussian_sigma_analytic(3.0, eps, DELTA) == pytest.approx(3.0 * sigma)  # linear in sensitivity
    if eps < 1:
        classic = gaussian_sigma_classic(1.0, eps, DELTA)
        assert sigma < classic
        assert gaussian_delta(eps, 1.0 / classic) <= DELTA  # the classic theorem holds where it applies


def test_basic_composition():
    assert basic_composition(0.1, 0.0, 10) == pytest.approx((1.0, 0.0))
    assert basic_composition(0.5, 1e-6, 4) == pytest.approx((2.0, 4e-6))


def test_advanced_composition_hand_example():
    # eps = 0.1, k = 100, delta' = 1e-5, delta = 0:
    # 0.1 sqrt(200 ln 1e5) + 100 * 0.1 * (e^0.1 - 1)/(e^0.1 + 1)
    # = 0.1 * sqrt(2302.585093) + 10 * 0.0499584 = 4.798526 + 0.499584 = 5.298110
    eps, delta = advanced_composition(0.1, 0.0, 100, 1e-5)
    assert eps == pytest.approx(5.298110, abs=1e-6)
    assert delta == pytest.approx(1e-5)
    eps2, delta2 = advanced_composition(0.2, 1e-7, 50, 1e-6)
    expected = 0.2 * math.sqrt(100 * math.log(1e6)) + 50 * 0.2 * (math.exp(0.2) - 1) / (math.exp(0.2) + 1)
    assert eps2 == pytest.approx(expected, rel=1e-12)
    assert delta2 == pytest.approx(50 * 1e-7 + 1e-6)


def test_advanced_beats_basic_only_for_many_compositions():
    assert advanced_composition(0.1, 0.0, 10, 1e-3)[0] > basic_composition(0.1, 0.0, 10)[0]
    assert advanced_composition(0.1, 0.0, 1000, 1e-3)[0] < basic_composition(0.1, 0.0, 1000)[0]


@pytest.mark.parametrize("eps,q", [(1.0, 0.01), (0.5, 0.3), (3.0, 1.0), (1e-8, 0.5)])
def test_poisson_amplification_closed_form(eps, q):
    amp_eps, amp_delta = poisson_amplification(eps, q, delta=1e-5)
    assert amp_eps == pytest.approx(math.log(1 - q + q * math.exp(eps)), rel=1e-9)
    assert amp_delta == pytest.approx(q * 1e-5)
    assert amp_eps <= eps
    assert poisson_amplification(eps, q)[1] == 0.0


def test_clip_rows():
    x = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    np.testing.assert_allclose(clip_rows(x, 1.0), [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]])
    np.testing.assert_allclose(clip_rows(np.array([-5.0, 0.5]), 1.0), [-1.0, 0.5])


def test_private_mean_sensitivity_relations():
    assert private_mean_sensitivity(100, 2.0) == pytest.approx(0.04)  # replace-one: 2 clip / n
    assert private_mean_sensitivity(100, 2.0, "add_remove") == pytest.approx(0.02)
    with pytest.raises(ValueError, match="'swap'"):
        private_mean_sensitivity(100, 2.0, "swap")


def test_private_mean_unbiased_for_the_clipped_mean():
    rng = np.random.default_rng(2)
    x = rng.normal(0.2, 1.0, size=(500, 3))
    clip, eps = 1.5, 0.5
    target = clip_rows(x, clip).mean(axis=0)
    sigma = private_mean_sigma(500, clip, eps, DELTA)
    draws = np.stack([private_mean(x, clip, eps, DELTA, rng) for _ in range(4000)])
    se = sigma / math.sqrt(len(draws))
    np.testing.assert_array_less(np.abs(draws.mean(axis=0) - target), 5 * se)
    assert draws.std(axis=0) == pytest.approx(np.full(3, sigma), rel=0.05)
    scalar = private_mean(np.array([0.1, 0.2, 5.0]), 1.0, 1.0, DELTA, rng)
    assert isinstance(scalar, float)


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: laplace_mechanism(0.0, 1.0, 0.0, np.random.default_rng()), r"epsilon .*> 0, got 0\.0"),
        (lambda: laplace_mechanism(0.0, -1.0, 1.0, np.random.default_rng()), "-1.0"),
        (lambda: laplace_mechanism(0.0, 1.0, 1.0, 42), "42"),
        (lambda: gaussian_mechanism(0.0, -0.5, np.random.default_rng()), "-0.5"),
        (lambda: gaussian_sigma_analytic(1.0, 1.0, 1.5), r"delta must be in \(0, 1\), got 1\.5"),
        (lambda: gaussian_sigma_analytic(1.0, -1.0, DELTA), "-1.0"),
        (lambda: gaussian_sigma_classic(1.0, 0.5, 0.0), "got 0.0"),
        (lambda: basic_composition(0.1, 1.0, 3), r"\[0, 1\), got 1\.0"),
        (lambda: basic_composition(0.1, 0.0, 0), "got 0"),
        (lambda: advanced_composition(0.1, 0.0, 10, 0.0), r"delta_prime .*got 0\.0"),
        (lambda: poisson_amplification(1.0, 0.0), r"q .*\(0, 1\], got 0\.0"),
        (lambda: poisson_amplification(-1.0, 0.5), "-1.0"),
        (lambda: private_mean(np.ones((3, 2)), 0.0, 1.0, DELTA, np.random.default_rng()), r"clip .*got 0\.0"),
        (lambda: private_mean(np.array([1.0, np.inf]), 1.0, 1.0, DELTA, np.random.default_rng()), "finite"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_value(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()
