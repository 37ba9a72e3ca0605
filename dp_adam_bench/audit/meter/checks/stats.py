"""What every statistical check of the meter shares: the level of a row (``ALPHA``, a union bound over its checks),
the error whose detection probability each check states (``EFFECT``), the z-test arithmetic, and the estimates of
one release the per-release checks read (:class:`ReleaseStats`). Pure functions of numbers (tests/test_meter.py
simulates them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

#: the probability that a correct mechanism fails any check of a row (union bound over the checks)
ALPHA = 1e-3
#: the relative error whose detection probability (power) is stated
EFFECT = 0.10


def critical(alpha: float, tests: int, two_sided: bool = True) -> float:
    """The z a test must exceed to fail at level alpha / tests."""
    level = alpha / tests
    return float(stats.norm.isf(level / 2 if two_sided else level))


def power_at(effect: float, se: float, crit: float) -> float:
    """P[|z| > crit] (two-sided, far tail neglected) when the true relative error is ``effect``, the SE ``se``."""
    if not se > 0:
        return 1.0
    return float(stats.norm.cdf(abs(effect) / se - crit))


def ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 1 (a noise-free release stated as noise-free) and a / 0 = inf."""
    if b > 0:
        return a / b
    return 1.0 if a == 0 else math.inf


def z_score(diff: float, se: float) -> float:
    """diff / se, with 0 / 0 = 0 and diff / 0 = +-inf."""
    if se > 0 and math.isfinite(se):
        return diff / se
    if diff == 0 or not math.isfinite(se):
        return 0.0 if diff == 0 or se > 0 else math.copysign(math.inf, diff)
    return math.copysign(math.inf, diff)


def z_of_p(p: float) -> float:
    """The two-sided normal z of p-value ``p`` (inf for 0)."""
    return float(stats.norm.isf(max(p / 2, 1e-300))) if p > 0 else math.inf


@dataclass
class ReleaseStats:
    """Estimates for one release from its whitened arrays (:func:`~dp_adam_bench.audit.meter.checks.release.
    release_stats`), each the statistic of one check: the slope (``sensitivity``), the std (``noise_std``), the lag
    statistic (``correlation``), the residual (``noise_covariance``)."""

    slope: float
    slope_se: float  # relative
    std: float
    std_se: float  # relative (of the std, under the claim)
    group_std: dict[str, float]
    group_n: dict[str, int]
    lag_q: float  # sum_l n_l rho_l^2, chi-square with LAGS degrees of freedom under the claim
    lags: int
    n: int
    #: the whitened residual C (y - x), (steps, coordinates): std * white noise under the claim
    resid: np.ndarray | None = field(default=None, repr=False)
    #: norm class -> (slope, relative SE) on the own coordinates of that class's examples
    class_slope: dict[str, tuple[float, float]] = field(default_factory=dict)
