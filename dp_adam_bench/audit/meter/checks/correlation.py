"""The ``correlation`` check (per release): the whitened residual's autocorrelation at lags 1..``LAGS`` across steps
(a chi-square test of sum_l n_l rho_l^2 with LAGS degrees of freedom): the noise is C^{-1} z with the mechanism's own
C, not a reused or mis-correlated draw. No power is stated; a draw reused at a longer lag, or shared between
releases, is the ``noise_covariance`` check's (noise_covariance.py)."""

from __future__ import annotations

import numpy as np
from scipy import stats

from dp_adam_bench.audit.meter.checks.stats import ReleaseStats
from dp_adam_bench.audit.meter.result import MeterCheck

#: lags of the autocorrelation test
LAGS = 10


def lag_statistic(resid: np.ndarray, std: float) -> tuple[float, int]:
    """(sum_l n_l rho_l^2 over lags 1..min(LAGS, steps - 1), the number of lags): rho_l the residual's
    autocorrelation at lag l over n_l products, chi-square with that many degrees of freedom for white noise."""
    lags = min(LAGS, len(resid) - 1)
    q = 0.0
    for lag in range(1, lags + 1):
        prod = resid[lag:] * resid[:-lag]
        rho = float(prod.mean()) / (std * std) if std > 0 else 0.0
        q += prod.size * rho * rho
    return q, lags


def correlation_check(name: str, s: ReleaseStats, crit: float) -> MeterCheck:
    """The lag statistic of release ``name`` as a z (from its chi-square p-value), one-sided at ``crit``."""
    p = float(stats.chi2.sf(s.lag_q, s.lags)) if s.lags else 1.0
    zq = float(stats.norm.isf(max(p / 2, 1e-300))) if p < 1 else 0.0
    return MeterCheck(
        "correlation",
        name,
        s.lag_q / max(s.lags, 1),
        1.0,
        zq,
        zq <= crit,
        None,
        f"whitened residual, lags 1..{s.lags}: chi2 / df",
    )
