"""One release's statistics and its three checks (``sensitivity``, ``noise_std``, ``correlation``, each in the file
named for it): the release y and its predicted mean x (steps, coordinates) whitened by the mechanism's strategy C
(released noise std * C^{-1} z, so C (y - x) = std * z is white noise under the claim)."""

from __future__ import annotations

import math

import numpy as np

from dp_adam_bench.audit.meter.checks.correlation import correlation_check, lag_statistic
from dp_adam_bench.audit.meter.checks.noise_std import group_stds, noise_std_check, rms
from dp_adam_bench.audit.meter.checks.sensitivity import class_slopes, sensitivity_check, slope_fit
from dp_adam_bench.audit.meter.checks.stats import ReleaseStats
from dp_adam_bench.audit.meter.result import MeterCheck


def release_stats(
    y: np.ndarray,
    x: np.ndarray,
    strategy: np.ndarray | None,
    groups: dict[str, np.ndarray] | None = None,
    classes: dict[str, np.ndarray] | None = None,
) -> ReleaseStats:
    """``y``: the release, ``x``: its predicted mean, both (steps, coordinates); ``strategy``: C (None: I);
    ``groups``: name -> boolean mask over the coordinates (noise std by group); ``classes``: norm class -> mask
    over the coordinates (the slope by class)."""
    t = len(y)
    if strategy is not None:
        c = np.asarray(strategy, dtype=np.float64)[:t, :t]
        y, x = c @ y, c @ x
    resid = y - x
    n = resid.size
    std = rms(resid)
    slope, slope_se = slope_fit(y, x, std)
    group_std, group_n = group_stds(resid, groups)
    q, lags = lag_statistic(resid, std)
    return ReleaseStats(
        slope,
        slope_se,
        std,
        1 / math.sqrt(2 * n),
        group_std,
        group_n,
        q,
        lags,
        n,
        resid,
        class_slopes(y, x, std, classes),
    )


def release_checks(name: str, s: ReleaseStats, stated_std: float, alpha_crit: float) -> list[MeterCheck]:
    """The sensitivity, noise_std and correlation checks of one release."""
    return [
        sensitivity_check(name, s, alpha_crit),
        noise_std_check(name, s, stated_std, alpha_crit),
        correlation_check(name, s, alpha_crit),
    ]
