"""A simulated one-run audit of a pure Gaussian mechanism, shared by the tests of the audit's lower bounds."""

from __future__ import annotations

from dp_adam_bench.audit.bound import Guesses, count_correct

FRACTIONS = (0.01, 0.05, 0.45)  # the share of canaries guessed each way, as the white-box audit's tests do


def gaussian_audit(rng, mu: float, m: int, bound, confidence: float = 0.95) -> float:
    """One run of a pure Gaussian mechanism: canary i in with probability 1/2, its score mu * [in] + N(0, 1), so the
    run is exactly mu-GDP with respect to each canary; the largest mu that ``bound(m, r, v, level)`` rejects over
    the tests of FRACTIONS (Bonferroni)."""
    included = rng.random(m) < 0.5
    scores = mu * included + rng.standard_normal(m)
    level = (1 - confidence) / len(FRACTIONS)
    best = 0.0
    for frac in FRACTIONS:
        k = max(1, int(frac * m))
        r, v = count_correct(Guesses(k, k).guess(scores), included)
        best = max(best, bound(m, r, v, level))
    return best
