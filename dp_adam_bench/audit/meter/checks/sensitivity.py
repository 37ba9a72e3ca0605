"""The ``sensitivity`` check (per release): the slope a of the whitened release on the whitened prediction C x, the
meter's own clipped mean x_t = (1/B) sum_{i in batch_t} clip(s_t g_i; C). a = 1 means each example moves the release
by exactly its clipped contribution, C / B in L2 (a z-test, SE from the measured noise; power against a slope off by
``EFFECT``). The slope of each norm class (the canaries far above, just above, just below and at half of C) is
reported in the detail; only the pooled slope is tested."""

from __future__ import annotations

import math

import numpy as np

from dp_adam_bench.audit.meter.checks.stats import EFFECT, ReleaseStats, power_at, z_score
from dp_adam_bench.audit.meter.result import MeterCheck


def slope_fit(y: np.ndarray, x: np.ndarray, std: float) -> tuple[float, float]:
    """The least-squares slope of ``y`` on ``x`` through the origin and its SE for noise of std ``std`` (relative:
    the slope is 1 under the claim); nan and inf where x is 0."""
    xx = float((x * x).sum())
    slope = float((y * x).sum() / xx) if xx > 0 else math.nan
    return slope, (std / math.sqrt(xx) if xx > 0 else math.inf)


def class_slopes(
    y: np.ndarray, x: np.ndarray, std: float, classes: dict[str, np.ndarray] | None
) -> dict[str, tuple[float, float]]:
    """Norm class -> (slope, relative SE) on the coordinates of ``classes``' mask (classes with no signal left out)."""
    out = {}
    for name, mask in (classes or {}).items():
        cx = x[:, mask]
        if float((cx * cx).sum()) > 0:
            out[name] = slope_fit(y[:, mask], cx, std)
    return out


def sensitivity_check(name: str, s: ReleaseStats, crit: float) -> MeterCheck:
    """The pooled slope of release ``name`` against 1, two-sided at ``crit``."""
    z = z_score(s.slope - 1, s.slope_se)
    by_class = ", ".join(f"{k} {a:.3f} +- {se:.3f}" for k, (a, se) in s.class_slope.items())
    return MeterCheck(
        "sensitivity",
        name,
        s.slope,
        1.0,
        z,
        abs(z) <= crit,
        power_at(EFFECT, s.slope_se, crit),
        "slope of the release on its predicted clipped mean"
        + ("; by norm (own coordinates): " + by_class if s.class_slope else ""),
    )
