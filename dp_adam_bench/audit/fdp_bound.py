"""The f-DP one-run audit of Mahloujifar, Melis & Chaudhuri, "Auditing f-Differential Privacy in One Run" (ICML
2025, PMLR 267, arXiv:2410.22235), for the Gaussian trade-off curves G_mu: the largest mu for which the guesses show
that the run is not mu-GDP.

The game is the one of :mod:`dp_adam_bench.audit.bound` (Steinke, Nasr & Jagielski 2023): m canaries, each in with
probability 1/2, the auditor guesses in or out on r of them and v of the guesses are right. Both papers bound the
probability of v or more correct guesses under the hypothesis that the run is private with respect to each canary;
Steinke et al. test one (epsilon, delta) point of the privacy curve (through e^eps randomized response plus a delta
term), Mahloujifar et al. test a whole trade-off function f at once (their reconstruction game with k = 2 possible
values per canary, abstention allowed). Their numerical bound with abstention (the paper's Algorithm 3,
``audit_rh_with_cap`` in its code listing), in our letters, with tau the significance level and fbar^{-1} the
inverse of fbar(x) = 1 - f(x):

    r_v = tau v / m,   h_v = tau (r - v) / m,
    for i = v - 1, ..., 0:   h_i = max(h_{i+1}, fbar^{-1}(r_{i+1})),
                             r_i = r_{i+1} + i / (r - i) * (h_i - h_{i+1}),
    f is rejected at level tau when r_0 + h_0 > r / m.

In outline (our reading of the argument): were P[at least v correct] >= tau, r_i and h_i would lower-bound the
average over the canaries of the probability that the canary is guessed right (resp. wrong) in an outcome with at
least i correct guesses; f-DP links the two, since a wrong guess on a canary is a right guess on its neighbour with
the bit flipped (an event of mass y on one side has at least fbar^{-1}(y) on the other). At i = 0 the two true
values add up to the expected fraction of canaries guessed, r / m exactly, so lower bounds above it are a
contradiction: v correct guesses have probability below tau under f-DP.

For mu-GDP (Dong, Roth & Su 2022, arXiv:1905.02383, Def. 2.6) f = G_mu, G_mu(x) = Phi(Phi^{-1}(1 - x) - mu), so
fbar^{-1}(y) = Phi(Phi^{-1}(y) - mu). A run that is not mu-GDP is not mu'-GDP for any mu' < mu either (G_mu' >=
G_mu), so each rejected mu is a valid lower bound whichever one the bisection ends on; on every count we tried the
rejected mu form an interval [0, mu*) (tests/test_fdp_bound.py), so bisection finds its end mu*. Read as an
epsilon at delta through the mu-GDP curve (:func:`~dp_adam_bench.audit.bound.gdp_epsilon`), it is the epsilon of the
Gaussian mechanism whose curve passes through (epsilon, delta): what jax_privacy's
``CanaryScoreAuditor.epsilon_one_run_fdp`` reports (tests/test_audit_outside.py compares the two).

Difference from :func:`~dp_adam_bench.audit.bound.gdp_mu_lower_bound` on the same (m, r, v): that one applies
Steinke et al.'s one-point bound at every point (epsilon, delta_mu(epsilon)) of the curve and keeps the best, each
point paying its delta as an additive 2 m delta term; this one uses the curve inside the bound itself. It is never
below the other on the counts tests/test_fdp_bound.py tries, and 1.25 to 1.6 times it on the privacy_audit rows.
"""

from __future__ import annotations

import math

from scipy.special import ndtr, ndtri

from dp_adam_bench.audit.bound import check_counts, check_unit

#: the largest mu searched: G_64 is indistinguishable from no privacy at all at any significance we use
MU_MAX = 64.0
#: bisection steps on mu: the bound is found to MU_MAX / 2^steps at worst, far below what a row can resolve
BISECTION_STEPS = 40


def gaussian_blow_up_inverse(y: float, mu: float) -> float:
    """fbar^{-1}(y) for f = G_mu: Phi(Phi^{-1}(y) - mu), the least probability under one neighbour of an event of
    probability ``y`` under the other (Dong, Roth & Su 2022, Def. 2.6). 0 at y = 0 and 1 at y = 1."""
    if y <= 0.0:
        return 0.0
    if y >= 1.0:
        return 1.0
    return float(ndtr(ndtri(y) - mu))


def fdp_rejects(m: int, r: int, v: int, mu: float, significance: float) -> bool:
    """True when v correct guesses out of r (m canaries) reject mu-GDP at ``significance``: Mahloujifar et al.'s
    Algorithm 3 with f = G_mu (module docstring). mu = 0 (perfect privacy) is rejected only by an impossible count."""
    check_counts(m, r, v)
    check_unit("significance", significance, open_low=True, open_high=True)
    if not (isinstance(mu, (int, float)) and math.isfinite(mu) and mu >= 0):
        raise ValueError(f"mu must be a finite number >= 0, got {mu!r}")
    return _rejects(m, r, v, float(mu), float(significance))


def _rejects(m: int, r: int, v: int, mu: float, tau: float) -> bool:
    if r == 0 or v == 0:
        return False  # r_0 + h_0 = tau r / m < r / m
    right, wrong = tau * v / m, tau * (r - v) / m
    for i in range(v - 1, -1, -1):
        wrong_next = max(wrong, gaussian_blow_up_inverse(right, mu))
        if wrong_next == wrong:  # nothing moves any more: h and r stay as they are down to i = 0
            break
        # a probability: capping it only weakens the test (and once it reaches 1, fbar^{-1}(1) = 1 rejects)
        right = min(right + i / (r - i) * (wrong_next - wrong), 1.0)
        wrong = wrong_next
    return right + wrong > r / m


def fdp_mu_lower_bound(m: int, r: int, v: int, significance: float = 0.05) -> float:
    """The largest mu that v correct guesses out of r (m canaries) reject at ``significance`` under Mahloujifar et
    al.'s f-DP audit: with probability >= 1 - significance the run is not mu-GDP for any mu below it (0 when nothing
    is rejected; :data:`MU_MAX` when even that is)."""
    check_counts(m, r, v)
    check_unit("significance", significance, open_low=True, open_high=True)
    tau = float(significance)
    if not _rejects(m, r, v, 0.0, tau):
        return 0.0
    if _rejects(m, r, v, MU_MAX, tau):
        return MU_MAX
    lo, hi = 0.0, MU_MAX
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        if _rejects(m, r, v, mid, tau):
            lo = mid
        else:
            hi = mid
    return lo


def fdp_max_mu(m: int, r: int, significance: float = 0.05) -> float:
    """The most r guesses on m canaries can show under this audit: the bound when every guess is right."""
    return fdp_mu_lower_bound(m, r, r, significance)
