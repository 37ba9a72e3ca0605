"""The Gaussian mechanism, exactly: delta(eps), its inverse and the analytic calibration (Balle & Wang 2018,
"Improving the Gaussian mechanism for differential privacy", arXiv:1805.06530, Theorem 8 and Algorithm 1).

The same curve is the mu-GDP -> (eps, delta) dual (Dong, Roth & Su 2022, "Gaussian differential privacy",
arXiv:1905.02383, Cor. 2.13), which the GDP-CLT accountant and every composition of Gaussian events use.
"""

from __future__ import annotations

import math

from scipy import optimize
from scipy.special import log_ndtr

from dp_adam_bench.privacy.accounting.checks import (
    check_delta,
    check_epsilon,
    check_positive,
    check_sigma,
    is_real,
)


def log_gaussian_delta(epsilon: float, mu: float) -> float:
    """log delta(eps) of the Gaussian mechanism; -inf where delta underflows. No input checks."""
    log_a = float(log_ndtr(-epsilon / mu + mu / 2))
    log_b = epsilon + float(log_ndtr(-epsilon / mu - mu / 2))
    diff = min(log_b - log_a, 0.0)  # b <= a mathematically; clip float noise
    if diff == 0.0:
        return -math.inf
    # log(a - b) = log a + log(1 - e^{diff}), with log(-expm1) accurate for diff near 0 and very negative.
    return log_a + math.log(-math.expm1(diff))


def gaussian_delta(epsilon: float, mu: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with mu = sensitivity / sigma.

    Balle & Wang (2018), Theorem 8: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2). Evaluated in
    log space with ``scipy.special.log_ndtr`` so that large eps (where both terms underflow) stays accurate.
    ``epsilon`` may be 0 (delta(0) is the total-variation distance 2 Phi(mu/2) - 1).
    """
    if not is_real(epsilon) or not math.isfinite(float(epsilon)) or float(epsilon) < 0:
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    mu = check_positive("mu", mu)
    return math.exp(log_gaussian_delta(float(epsilon), mu))


def gaussian_epsilon_unchecked(mu: float, delta: float) -> float:
    """:func:`gaussian_epsilon` without input checks (mu > 0 finite, 0 < delta < 1)."""
    log_delta = math.log(delta)
    if log_gaussian_delta(0.0, mu) <= log_delta:
        return 0.0
    hi = mu * mu / 2 + mu * math.sqrt(2 * -log_delta) + 1.0
    while log_gaussian_delta(hi, mu) > log_delta:
        hi *= 2
    return float(
        optimize.brentq(lambda e: log_gaussian_delta(e, mu) - log_delta, 0.0, hi, xtol=1e-13, rtol=1e-14)
    )


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest eps with delta(eps) <= ``delta`` for the Gaussian mechanism with mu = sensitivity / sigma.

    The inverse of :func:`gaussian_delta` by Brent's method (Balle & Wang 2018, Theorem 8); 0 when the
    mechanism is already (0, delta)-DP.
    """
    return gaussian_epsilon_unchecked(check_positive("mu", mu), check_delta(delta))


def gaussian_mu_unchecked(epsilon: float, delta: float) -> float:
    """:func:`gaussian_mu` without input checks."""
    log_delta = math.log(delta)
    lo, hi = 1e-3, 1.0
    while log_gaussian_delta(epsilon, lo) > log_delta:
        lo /= 2
    while log_gaussian_delta(epsilon, hi) < log_delta:
        hi *= 2
    return float(
        optimize.brentq(lambda m: log_gaussian_delta(epsilon, m) - log_delta, lo, hi, xtol=1e-14, rtol=1e-14)
    )


def gaussian_mu(epsilon: float, delta: float) -> float:
    """Largest mu = sensitivity / sigma for which the Gaussian mechanism is (eps, delta)-DP.

    The analytic Gaussian calibration of Balle & Wang (2018, Alg. 1) solved directly on Theorem 8 with Brent's
    method (delta(eps) is increasing in mu). ``sigma = sensitivity / gaussian_mu(eps, delta)``.
    """
    return gaussian_mu_unchecked(check_epsilon(epsilon), check_delta(delta))


def mf_epsilon(sigma: float, sensitivity: float, delta: float) -> float:
    """Epsilon of a DP-MF release without amplification (Choquette-Choo et al. 2022, "Multi-epoch matrix
    factorization mechanisms for private machine learning", arXiv:2211.06530; Ganesh et al. §5.2).

    The whole noisy stream C x + sigma z is one Gaussian mechanism whose L2 sensitivity is the strategy's
    sensitivity under the participation schedule, so eps = :func:`gaussian_epsilon` (mu = sensitivity /
    sigma).
    """
    sigma = check_sigma(sigma)
    sensitivity = check_positive("sensitivity", sensitivity)
    return gaussian_epsilon_unchecked(sensitivity / sigma, check_delta(delta))
