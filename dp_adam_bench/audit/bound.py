"""The one-run auditing bound of Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS
2023, arXiv 2305.08846, Theorem 3.1 and its Algorithm for the epsilon lower bound), computed with exact binomial
tails.

m canaries are each included independently with probability 1/2 (S_i = +1 in, -1 out); the auditor guesses
T_i in {-1, 0, +1} for r of them and W counts the correct guesses. If the training algorithm is (epsilon, delta)-DP
with respect to each canary, then for every v (Theorem 3.1)

    P[W >= v] <= beta(v) + 2 m delta * max_{i = 1..v} (P[v - i <= W' < v]) / i,   W' ~ Binomial(r, e^eps / (e^eps + 1)),

with beta(v) = P[W' >= v]. Observing v correct guesses, every epsilon whose right-hand side is at most the
significance level (1 - confidence) is rejected; the empirical lower bound is the largest rejected epsilon, found by
bisection (the right-hand side grows with epsilon).

Everything is computed here from the binomial probability mass function in log space (``math.lgamma``): no
approximation, and no dependency on scipy (which the tests use as an independent check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def check_counts(m: int, r: int, v: int) -> None:
    """ValueError, in one line, unless m (canaries), r (guesses) and v (correct) are integers with 0 <= v <= r <= m."""
    for name, x in (("m", m), ("r", r), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {x!r}")
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v (correct) <= r (guesses) <= m (canaries), got v={v}, r={r}, m={m}")


def check_unit(name: str, x: float, *, open_low: bool, open_high: bool) -> None:
    """ValueError, in one line naming ``name``, unless ``x`` is a finite number in the unit interval (ends as asked)."""
    if not (isinstance(x, (int, float)) and math.isfinite(x)):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    low_ok = x > 0 if open_low else x >= 0
    high_ok = x < 1 if open_high else x <= 1
    if not (low_ok and high_ok):
        lo, hi = ("(" if open_low else "["), (")" if open_high else "]")
        raise ValueError(f"{name} must be in {lo}0, 1{hi}, got {x}")


def binomial_pmf(r: int, p: float) -> np.ndarray:
    """P[Binomial(r, p) = k] for k = 0..r, exactly (log-space lgamma; 0 where it underflows)."""
    check_unit("p", p, open_low=False, open_high=False)
    k = np.arange(r + 1, dtype=np.float64)
    log_choose = math.lgamma(r + 1) - np.array([math.lgamma(x + 1) + math.lgamma(r - x + 1) for x in k])
    with np.errstate(divide="ignore", invalid="ignore"):
        log_p = np.where(k > 0, k * math.log(p) if p > 0 else -np.inf, 0.0)
        log_q = np.where(r - k > 0, (r - k) * math.log1p(-p) if p < 1 else -np.inf, 0.0)
    return np.exp(log_choose + log_p + log_q)


def accuracy_of(epsilon: float) -> float:
    """e^eps / (e^eps + 1): the accuracy of eps-DP randomized response, the most any guess can have."""
    return 1.0 / (1.0 + math.exp(-epsilon))


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The right-hand side of Steinke et al. Theorem 3.1: an upper bound on P[W >= v] for any (epsilon, delta)-DP
    algorithm audited with m canaries and r guesses (capped at 1)."""
    check_counts(m, r, v)
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon}")
    check_unit("delta", delta, open_low=False, open_high=False)
    pmf = binomial_pmf(r, accuracy_of(epsilon))
    tail = float(pmf[v:].sum())
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    below = np.cumsum(pmf[:v][::-1])  # below[i - 1] = P[v - i <= W' < v], i = 1..v
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(tail + 2 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, significance: float = 0.05) -> float:
    """The largest epsilon that v correct guesses out of r (m canaries) reject at ``significance``: with
    probability >= 1 - significance the audited algorithm is not (eps, delta)-DP for any eps below it. 0 when
    nothing is rejected."""
    check_counts(m, r, v)
    check_unit("significance", significance, open_low=True, open_high=True)
    if r == 0 or p_value(m, r, v, 0.0, delta) > significance:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) <= significance:
        lo, hi = hi, 2 * hi
        if hi > 1e3:  # only v = r with a vanishing significance could get here
            return lo
    for _ in range(60):
        mid = (lo + hi) / 2
        if p_value(m, r, v, mid, delta) <= significance:
            lo = mid
        else:
            hi = mid
    return lo


def max_epsilon(m: int, r: int, delta: float, significance: float = 0.05) -> float:
    """The most r guesses on m canaries can ever show: the bound when every guess is correct."""
    return epsilon_lower_bound(m, r, r, delta, significance)


@dataclass(frozen=True)
class Guesses:
    """The auditor's guesses: +1 on the ``k_plus`` highest scores, -1 on the ``k_minus`` lowest, 0 elsewhere."""

    k_plus: int
    k_minus: int

    def guess(self, scores: np.ndarray, tiebreak: np.ndarray | None = None) -> np.ndarray:
        """T in {-1, 0, +1}^m. Ties are broken by ``tiebreak`` (a key independent of which canaries are in, e.g. a
        seeded random permutation), never by the inclusion itself."""
        scores = np.asarray(scores, dtype=np.float64)
        m = len(scores)
        if self.k_plus < 0 or self.k_minus < 0 or self.k_plus + self.k_minus > m:
            raise ValueError(
                f"guesses k+={self.k_plus}, k-={self.k_minus} need k+ + k- <= m = {m}, both >= 0"
            )
        if not np.all(np.isfinite(scores)):
            raise ValueError("canary scores must be finite (a NaN or inf score would rank arbitrarily)")
        key = np.arange(m) if tiebreak is None else np.asarray(tiebreak)
        order = np.lexsort((key, scores))  # ascending score, ties by the key
        t = np.zeros(m, dtype=np.int64)
        if self.k_minus:
            t[order[: self.k_minus]] = -1
        if self.k_plus:
            t[order[m - self.k_plus :]] = 1
        return t


def count_correct(guesses: np.ndarray, included: np.ndarray) -> tuple[int, int]:
    """(r, v): how many canaries were guessed and how many of those guesses were right."""
    s = np.where(np.asarray(included, dtype=bool), 1, -1)
    g = np.asarray(guesses)
    r = int(np.count_nonzero(g))
    v = int(np.count_nonzero(g * s == 1))
    return r, v


# --- a Gaussian (f-DP) bound from the same guesses ---------------------------------------------------------------
#: grid points of epsilon at which the privacy curve of mu-GDP is tested (any grid gives a valid test)
GDP_GRID = 160


def _log_choose(r: int) -> np.ndarray:
    k = np.arange(r + 1, dtype=np.float64)
    return math.lgamma(r + 1) - np.array([math.lgamma(x + 1) + math.lgamma(r - x + 1) for x in k])


def _p_values(m: int, r: int, v: int, epsilons: np.ndarray, deltas: np.ndarray, log_choose: np.ndarray):
    """Steinke et al. Theorem 3.1's right-hand side at every (epsilon_j, delta_j) at once (as :func:`p_value`)."""
    eps = np.asarray(epsilons, dtype=np.float64)[:, None]
    k = np.arange(r + 1, dtype=np.float64)[None, :]
    log_p = -np.logaddexp(0.0, -eps)  # log of e^eps / (e^eps + 1)
    log_q = -np.logaddexp(0.0, eps)
    pmf = np.exp(log_choose[None, :] + k * log_p + (r - k) * log_q)
    tail = pmf[:, v:].sum(1)
    if v == 0:
        return np.minimum(tail, 1.0)
    below = np.cumsum(pmf[:, :v][:, ::-1], axis=1)
    alpha = (below / np.arange(1, v + 1)[None, :]).max(1)
    return np.minimum(tail + 2 * m * np.asarray(deltas) * alpha, 1.0)


def gdp_p_value(m: int, r: int, v: int, mu: float, log_choose: np.ndarray | None = None) -> float:
    """An upper bound on P[W >= v] for any mu-GDP algorithm audited with m canaries and r guesses.

    A mu-GDP mechanism (Dong, Roth & Su 2022, "Gaussian differential privacy", JRSS-B, arXiv:1905.02383) is
    (epsilon, delta_mu(epsilon))-DP for *every* epsilon >= 0, with delta_mu(epsilon) = Phi(-epsilon / mu + mu / 2)
    - e^epsilon Phi(-epsilon / mu - mu / 2) (their Cor. 2.13; :func:`~dp_adam_bench.privacy.accounting.gaussian.
    gaussian_delta`). Steinke, Nasr & Jagielski's Theorem 3.1 therefore holds at each point of that curve, and so
    does the smallest of the bounds over a grid of epsilons: the whole privacy curve is audited instead of the one
    (epsilon, delta) of :func:`p_value`. This is the point-wise (envelope) form of the f-DP one-run audit of
    Mahloujifar, Melis & Chaudhuri (ICML 2025, arXiv:2410.22235), which uses the trade-off function f = G_mu at
    once and is tighter (:mod:`dp_adam_bench.audit.fdp_bound`); it needs no assumption beyond the Gaussian curve
    being the one tested.
    """
    check_counts(m, r, v)
    if not (math.isfinite(mu) and mu >= 0):
        raise ValueError(f"mu must be a finite number >= 0, got {mu}")
    if r == 0:
        return 1.0
    lc = _log_choose(r) if log_choose is None else log_choose
    if mu == 0:  # 0-GDP: perfectly private, every guess a fair coin
        return float(_p_values(m, r, v, np.zeros(1), np.zeros(1), lc)[0])
    hi = mu * mu / 2 + 10 * mu + 1.0  # delta_mu(hi) < Phi(-10): beyond it the bound only grows with epsilon
    eps = np.linspace(0.0, hi, GDP_GRID)
    return float(_p_values(m, r, v, eps, np.exp(log_gdp_delta(eps, mu)), lc).min())


def log_gdp_delta(epsilons: np.ndarray, mu: float) -> np.ndarray:
    """log delta_mu(epsilon) of mu-GDP at every epsilon (Dong, Roth & Su 2022, Cor. 2.13), vectorised as
    :func:`~dp_adam_bench.privacy.accounting.gaussian.log_gaussian_delta` (which tests/test_audit_gdp.py
    compares it with): log Phi(-eps / mu + mu / 2) + log(1 - e^{eps + log Phi(-eps / mu - mu / 2) - log Phi(...)})."""
    from scipy.special import log_ndtr

    eps = np.asarray(epsilons, dtype=np.float64)
    log_a = log_ndtr(-eps / mu + mu / 2)
    diff = np.minimum(eps + log_ndtr(-eps / mu - mu / 2) - log_a, 0.0)
    with np.errstate(divide="ignore"):
        return np.where(diff == 0.0, -np.inf, log_a + np.log(-np.expm1(diff)))


def gdp_mu_lower_bound(m: int, r: int, v: int, significance: float = 0.05) -> float:
    """The largest mu that v correct guesses out of r (m canaries) reject at ``significance``: with probability
    >= 1 - significance the audited algorithm is not mu-GDP for any mu below it (0 when nothing is rejected).
    :func:`gdp_p_value` grows with mu (delta_mu(epsilon) does, at every epsilon), so bisection finds it."""
    check_counts(m, r, v)
    check_unit("significance", significance, open_low=True, open_high=True)
    if r == 0:
        return 0.0
    lc = _log_choose(r)
    if gdp_p_value(m, r, v, 0.0, lc) > significance:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_p_value(m, r, v, hi, lc) <= significance:
        lo, hi = hi, 2 * hi
        if hi > 64:
            return lo
    for _ in range(32):
        mid = (lo + hi) / 2
        if gdp_p_value(m, r, v, mid, lc) <= significance:
            lo = mid
        else:
            hi = mid
    return lo


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon at ``delta`` of mu-GDP (0 for mu = 0): how a mu lower bound reads as an epsilon. It is a lower
    bound on the run's epsilon at delta only if the run's privacy curve is a Gaussian one (exact for the
    non-amplified Gaussian releases; for the others, the Gaussian-curve assumption under which Nasr et al. 2023,
    arXiv:2302.07956, read their audits as epsilons)."""
    if mu <= 0:
        return 0.0
    from dp_adam_bench.privacy.accounting.gaussian import gaussian_epsilon

    return gaussian_epsilon(mu, delta)
