"""The f-DP one-run bound (dp_adam_bench.audit.fdp_bound, Mahloujifar, Melis & Chaudhuri 2025, Algorithm 3 with
f = G_mu): valid on a pure Gaussian mechanism of known mu, monotone where it must be, at its limits (perfect guesses
show a lot, coin flips nothing), never weaker than the point-wise Gaussian bound on the same counts, and bad input
refused in one line. tests/test_audit_outside.py compares it with jax_privacy's implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from audit_sim import gaussian_audit
from scipy.stats import norm

from dp_adam_bench.audit.bound import (
    epsilon_lower_bound,
    gdp_epsilon,
    gdp_mu_lower_bound,
)
from dp_adam_bench.audit.fdp_bound import (
    MU_MAX,
    fdp_max_mu,
    fdp_mu_lower_bound,
    fdp_rejects,
    gaussian_blow_up_inverse,
)

LEVEL = 0.05 / 18  # one of the white-box audit's 18 tests


def _gaussian_audit(rng, mu: float, m: int) -> float:
    return gaussian_audit(rng, mu, m, fdp_mu_lower_bound)


def test_blow_up_inverse_inverts_the_gaussian_trade_off_curve():
    """fbar(x) = 1 - G_mu(x) with G_mu(x) = Phi(Phi^{-1}(1 - x) - mu) (Dong, Roth & Su 2022, Def. 2.6), written
    here with scipy.stats.norm; fbar^{-1} must undo it, and be the identity at mu = 0."""
    for mu in (0.1, 1.0, 3.0):
        for x in (1e-6, 0.01, 0.3, 0.7, 0.999):
            fbar = 1 - norm.cdf(norm.ppf(1 - x) - mu)
            assert math.isclose(gaussian_blow_up_inverse(fbar, mu), x, rel_tol=1e-7, abs_tol=1e-12)
    assert gaussian_blow_up_inverse(0.37, 0.0) == pytest.approx(0.37)
    assert gaussian_blow_up_inverse(0.0, 2.0) == 0.0 and gaussian_blow_up_inverse(1.0, 2.0) == 1.0


def test_bound_on_a_gaussian_mechanism_never_exceeds_its_mu_beyond_its_confidence():
    rng = np.random.default_rng(3)
    mu, reps = 1.0, 80
    bounds = np.array([_gaussian_audit(rng, mu, 400) for _ in range(reps)])
    assert (bounds > mu).mean() <= 0.05  # 95 % confidence
    assert np.median(bounds) > 0.3  # and it does see the mechanism


def test_a_stronger_mechanism_and_more_canaries_show_more():
    rng = np.random.default_rng(8)
    weak, strong = _gaussian_audit(rng, 1.0, 2000), _gaussian_audit(rng, 4.0, 2000)
    assert 0 < weak < strong <= 4.0
    small, large = _gaussian_audit(rng, 3.0, 200), _gaussian_audit(rng, 3.0, 4000)
    assert 0 < small < large <= 3.0


def test_rejection_is_an_interval_of_mu_and_the_bound_its_end():
    m, r, v = 1000, 100, 80
    mu = fdp_mu_lower_bound(m, r, v, LEVEL)
    assert 0 < mu < MU_MAX
    assert fdp_rejects(m, r, v, 0.0, LEVEL) and fdp_rejects(m, r, v, 0.99 * mu, LEVEL)
    assert not fdp_rejects(m, r, v, 1.01 * mu, LEVEL) and not fdp_rejects(m, r, v, 3 * mu, LEVEL)


def test_bound_grows_with_correct_guesses_and_with_the_significance():
    m, r = 1000, 200
    by_v = [fdp_mu_lower_bound(m, r, v, LEVEL) for v in range(100, r + 1, 10)]
    assert by_v == sorted(by_v) and by_v[0] == 0.0 and by_v[-1] > 1.0
    by_level = [fdp_mu_lower_bound(m, r, 170, s) for s in (1e-4, 1e-3, 0.01, 0.05, 0.2)]
    assert by_level == sorted(by_level) and by_level[0] > 0


def test_perfect_guesses_on_many_canaries_show_a_large_mu_and_coin_flips_none():
    assert fdp_max_mu(10_000, 9_000, LEVEL) > 2.0  # G_2 already means epsilon ~ 8 at delta 1e-5
    assert fdp_max_mu(10_000, 9_000, LEVEL) > fdp_max_mu(1000, 900, LEVEL) > fdp_max_mu(100, 90, LEVEL) > 0
    assert fdp_mu_lower_bound(1000, 900, 450, LEVEL) == 0.0
    assert fdp_mu_lower_bound(1000, 900, 0, LEVEL) == 0.0 and fdp_mu_lower_bound(1000, 0, 0, LEVEL) == 0.0
    rng = np.random.default_rng(21)
    flips = [_gaussian_audit(rng, 0.0, 1000) for _ in range(20)]
    assert sum(b > 0 for b in flips) <= 2  # 95 % confidence: at most 1 in 20 expected


def test_never_weaker_than_the_pointwise_gaussian_bound_on_the_same_counts():
    """Using G_mu inside the bound vs. Steinke's bound at every point of the G_mu privacy curve (bound.py)."""
    for m, r, v in ((1000, 20, 17), (1000, 100, 75), (1000, 900, 544), (1000, 900, 886), (500, 450, 450)):
        fdp, gdp = fdp_mu_lower_bound(m, r, v, LEVEL), gdp_mu_lower_bound(m, r, v, LEVEL)
        assert fdp >= gdp > 0, (m, r, v, fdp, gdp)


#: ((m, r, v), f-DP epsilon, Steinke epsilon) at significance 0.05 / 18 and delta 1e-5, made once by jax_privacy 2.0.0
#: (an implementation no one here wrote) so that the check runs where it is not installed: for each counts,
#: ``a = CanaryScoreAuditor(in_scores, out_scores)`` on scores giving those counts at threshold 1 (tests/
#: test_audit_outside.py::_auditor_with_counts), then ``a.epsilon_one_run_fdp(0.05 / 18, 1e-5,
#: threshold_strategy=Explicit(1.0))`` and ``a.epsilon_one_run(...)`` with the same arguments, printed to 6 digits
JAX_PRIVACY_2_0_0 = (
    ((1000, 100, 69), 0.22444, 0.171637),
    ((1000, 100, 75), 0.565005, 0.434961),
    ((1000, 900, 544), 0.351169, 0.231236),
    ((1000, 900, 886), 5.01362, 3.42238),
    ((1000, 900, 900), 8.19177, 4.85443),
    ((500, 450, 262), 0.0949643, 0.0614109),
    ((1000, 20, 20), 1.22108, 0.803375),
    ((100, 10, 10), 0.266608, 0.195957),
)


@pytest.mark.parametrize("counts, fdp_eps, steinke_eps", JAX_PRIVACY_2_0_0)
def test_recorded_jax_privacy_numbers(counts, fdp_eps, steinke_eps):
    assert gdp_epsilon(fdp_mu_lower_bound(*counts, LEVEL), 1e-5) == pytest.approx(fdp_eps, rel=2e-5)
    assert epsilon_lower_bound(*counts, 1e-5, LEVEL) == pytest.approx(steinke_eps, rel=2e-5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: fdp_mu_lower_bound(10, 5, 6), "need 0 <= v"),
        (lambda: fdp_mu_lower_bound(10, 11, 3), "need 0 <= v"),
        (lambda: fdp_mu_lower_bound(10.0, 5, 3), "m must be an integer"),
        (lambda: fdp_mu_lower_bound(10, 5, 3, 0.0), r"significance must be in \(0, 1\)"),
        (lambda: fdp_mu_lower_bound(10, 5, 3, float("nan")), "significance must be a finite number"),
        (lambda: fdp_rejects(10, 5, 3, -0.5, 0.05), "mu must be a finite number >= 0, got -0.5"),
        (lambda: fdp_rejects(10, 5, 3, math.inf, 0.05), "mu must be a finite number >= 0"),
    ],
)
def test_bad_inputs_are_refused_in_one_line(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
