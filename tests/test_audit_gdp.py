"""The Gaussian (mu-GDP) one-run bound (dp_adam_bench.audit.bound.gdp_*): valid on a pure Gaussian mechanism of
known mu, rising towards mu with more canaries, at least as strong as the epsilon bound it generalises; and the
white-box audit's magnitude scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
from audit_sim import gaussian_audit

from dp_adam_bench.audit.bound import (
    epsilon_lower_bound,
    gdp_epsilon,
    gdp_mu_lower_bound,
    gdp_p_value,
    log_gdp_delta,
    p_value,
)
from dp_adam_bench.privacy.accounting.gaussian import gaussian_delta, log_gaussian_delta


def _gaussian_audit(rng, mu: float, m: int) -> float:
    return gaussian_audit(rng, mu, m, gdp_mu_lower_bound)


def test_vectorised_delta_is_the_accountants_gaussian_delta():
    eps = np.array([0.0, 0.3, 1.0, 4.0, 30.0])
    for mu in (0.2, 1.0, 3.0):
        want = np.array([log_gaussian_delta(float(e), mu) for e in eps])
        np.testing.assert_allclose(log_gdp_delta(eps, mu), want, rtol=1e-12)


def test_gdp_bound_never_exceeds_the_true_mu_beyond_its_confidence():
    rng = np.random.default_rng(11)
    mu, reps = 1.0, 60
    bounds = np.array([_gaussian_audit(rng, mu, 400) for _ in range(reps)])
    assert (bounds > mu).mean() <= 0.05  # 95 % confidence (it is conservative: in practice never)
    assert bounds.max() <= mu
    assert np.median(bounds) > 0.2  # and it does see the mechanism


def test_gdp_bound_rises_towards_the_truth_with_more_canaries():
    rng = np.random.default_rng(5)
    mu = 3.0
    small, large = _gaussian_audit(rng, mu, 200), _gaussian_audit(rng, mu, 4000)
    assert 0 < small < large <= mu
    # counting guesses on the k most extreme scores is what limits it: ~1.0 of 3 with 4,000 canaries
    assert large > 0.3 * mu


def test_gdp_p_value_is_the_least_epsilon_bound_on_the_gdp_curve_and_grows_with_mu():
    m, r, v = 1000, 100, 80
    for mu in (0.3, 1.0, 2.0):
        p = gdp_p_value(m, r, v, mu)
        for eps in np.linspace(0.0, 5.0, 11):
            assert p <= p_value(m, r, v, float(eps), gaussian_delta(float(eps), mu)) + 1e-12
    ps = [gdp_p_value(m, r, v, mu) for mu in (0.0, 0.5, 1.0, 2.0, 4.0)]
    assert ps == sorted(ps)


def test_gdp_bound_read_as_epsilon_is_at_least_the_one_point_bound_on_the_same_guesses():
    """Testing the whole mu-GDP curve is never weaker here than testing its one point (epsilon, 1e-5)."""
    delta, level = 1e-5, 0.05 / 3
    for m, r, v in ((1000, 20, 17), (1000, 100, 85), (1000, 900, 700), (1000, 900, 900)):
        eps_bound = epsilon_lower_bound(m, r, v, delta, level)
        gdp = gdp_epsilon(gdp_mu_lower_bound(m, r, v, level), delta)
        assert gdp >= eps_bound - 1e-3, (m, r, v, gdp, eps_bound)


def test_coin_flips_reject_no_mu():
    assert gdp_mu_lower_bound(1000, 900, 450) == 0.0
    assert gdp_epsilon(0.0, 1e-5) == 0.0
    with pytest.raises(ValueError, match="mu must be a finite number >= 0"):
        gdp_p_value(10, 5, 3, -1.0)


def test_magnitude_scores_see_a_clean_preconditioner():
    """noiseless_precond's v is the clean g^2: an absent canary's coordinate divides its noise by eps alone, so the
    update per unit of released gradient (the precond score) separates in from out at once."""
    from dp_adam_bench.audit.controls import CONTROLS
    from dp_adam_bench.audit.whitebox import audit_config, compose_config
    from dp_adam_bench.report import privacy_audit

    c = CONTROLS.get("noiseless_precond")
    cfg = compose_config(privacy_audit.overrides(c.variant, c.noise, c.sampler, 240))
    r = audit_config(cfg, canaries=200, background=40, control=c, control_name="noiseless_precond")
    precond = [t for t in r.tests if t.score == "precond"]
    assert max(t.correct / t.guesses for t in precond) == 1.0
    assert r.gdp_mu_lower > r.claimed_mu and "audit (GDP)" in r.caught_by
    assert math.isclose(r.gdp_epsilon_lower, gdp_epsilon(r.gdp_mu_lower, r.delta))
