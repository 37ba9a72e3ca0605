"""The three one-run bounds of dp_adam_bench.audit (Steinke et al.'s epsilon, the point-wise mu-GDP bound, and the
f-DP bound of Mahloujifar et al.) against an implementation no one here wrote: jax_privacy's auditing module
(``jax_privacy.auditing.CanaryScoreAuditor``, jax-privacy 2.0, the ``test`` extra), through its public interface,
on the same canary scores.

jax_privacy guesses one-sided ("in" for every score at or above a threshold; ``Explicit(threshold)`` skips its
search over thresholds), so the scores here are either a simulated Gaussian mechanism guessed on its k highest scores
(our ``Guesses(k, 0)``), or scores built to give jax_privacy the exact (m, r, v) counts of a two-sided test: both
bounds depend on the counts alone. Its f-DP method reports the epsilon at delta of the Gaussian curve it rejects,
which we compare with our mu read at the same delta.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

auditing = pytest.importorskip(
    "jax_privacy.auditing",
    reason="jax-privacy (the outside implementation) is not installed: pip install -e '.[test]'",
)
dp_accounting = pytest.importorskip("dp_accounting", reason="dp-accounting is not installed")

from dp_adam_bench.audit.bound import (  # noqa: E402
    Guesses,
    count_correct,
    epsilon_lower_bound,
    gdp_epsilon,
    gdp_mu_lower_bound,
)
from dp_adam_bench.audit.fdp_bound import fdp_mu_lower_bound  # noqa: E402

DELTA = 1e-5
LEVEL = 0.05 / 18
#: (m, r, v) of white-box, model-path and black-box tests of results/privacy_audit.csv, and two edge cases
COUNTS = (
    (1000, 100, 69),
    (1000, 100, 75),
    (1000, 900, 544),
    (1000, 900, 886),
    (1000, 900, 900),
    (500, 450, 262),
    (1000, 20, 20),
)


def _auditor_with_counts(m: int, r: int, v: int):
    """A jax_privacy auditor whose threshold 1 guesses r canaries with v right (of m: as many in as out, or as close
    as the counts allow), and that threshold."""
    n_in = max(v, min(m - (r - v), m // 2))
    in_scores = np.r_[np.ones(v), np.zeros(n_in - v)]
    out_scores = np.r_[np.ones(r - v), np.zeros(m - n_in - (r - v))]
    return auditing.CanaryScoreAuditor(in_scores, out_scores), 1.0


def _simulated(seed: int, mu: float, m: int, k: int):
    """A pure Gaussian mechanism's canary scores, our one-sided guesses on the k highest and their counts, and the
    jax_privacy auditor on the same scores with the threshold that guesses the same k."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    scores = mu * included + rng.standard_normal(m)
    r, v = count_correct(Guesses(k, 0).guess(scores), included)
    threshold = float(np.sort(scores)[m - k])
    return (m, r, v), auditing.CanaryScoreAuditor(scores[included], scores[~included]), threshold


def _cases():
    for m, r, v in COUNTS:
        yield (m, r, v), *_auditor_with_counts(m, r, v)
    for seed, mu, m, k in ((0, 1.0, 1000, 50), (1, 2.0, 1000, 200), (2, 4.0, 500, 100), (3, 0.5, 2000, 1000)):
        yield _simulated(seed, mu, m, k)


CASES = list(_cases())


@pytest.mark.parametrize("counts, auditor, threshold", CASES)
def test_steinke_epsilon_bound_matches_jax_privacy(counts, auditor, threshold):
    ours = epsilon_lower_bound(*counts, DELTA, LEVEL)
    theirs = auditor.epsilon_one_run(LEVEL, DELTA, threshold_strategy=auditing.Explicit(threshold))
    assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-5), counts


@pytest.mark.parametrize("counts, auditor, threshold", CASES)
def test_fdp_bound_matches_jax_privacy(counts, auditor, threshold):
    mu = fdp_mu_lower_bound(*counts, LEVEL)
    ours = gdp_epsilon(mu, DELTA)
    theirs = auditor.epsilon_one_run_fdp(LEVEL, DELTA, threshold_strategy=auditing.Explicit(threshold))
    assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-5), counts
    if theirs > 0:  # and as a mu: jax_privacy's epsilon is that of the Gaussian mechanism with sigma = 1 / mu
        assert 1 / dp_accounting.get_sigma_gaussian(theirs, DELTA) == pytest.approx(mu, rel=1e-3)


def test_gaussian_bound_is_jax_privacys_epsilon_bound_along_the_gdp_curve():
    """Our mu-GDP bound rejects mu when Steinke et al.'s test rejects some point (epsilon, delta_mu(epsilon)) of the
    mu-GDP curve. With jax_privacy's epsilon bound E(delta) at each delta of a grid, the mu-GDP curve through
    (E(delta), delta) is rejected, so the largest such mu (dp_accounting's Gaussian calibration) is the same bound
    computed outside; the two grids (ours over epsilon, this one over delta) agree to within their spacing."""
    deltas = np.logspace(-12, -0.7, 90)
    for counts, auditor, threshold in CASES[:5]:
        best = 0.0
        for delta in deltas:
            eps = auditor.epsilon_one_run(
                LEVEL, float(delta), threshold_strategy=auditing.Explicit(threshold)
            )
            if eps > 0:
                best = max(best, 1 / dp_accounting.get_sigma_gaussian(eps, float(delta)))
        ours = gdp_mu_lower_bound(*counts, LEVEL)
        assert ours == pytest.approx(best, rel=0.01), counts
        assert math.isfinite(ours) and ours > 0
