"""The ``noise_std`` check (per release): the std of the whitened residual against the std the privatizer states
(k sigma C / B, the variant's Phi comes from it; for g^2 k sigma S2), pooled and per coordinate group (the shared
coordinate, the examples' own coordinates, coordinates no example touches; on the model task also the bias). A
z-test on the pooled ratio, power against a std off by ``EFFECT``; a group off by more than the level allows fails it
too."""

from __future__ import annotations

import math

import numpy as np

from dp_adam_bench.audit.meter.checks.stats import EFFECT, ReleaseStats, power_at, ratio, z_score
from dp_adam_bench.audit.meter.result import MeterCheck


def rms(r: np.ndarray) -> float:
    """The root mean square of ``r`` (the std of noise of mean 0)."""
    return float(np.sqrt((r * r).mean()))


def group_stds(resid: np.ndarray, groups: dict[str, np.ndarray] | None) -> tuple[dict, dict]:
    """Group -> the std of the residual on the group's coordinates (nan for none), and group -> its entries."""
    group_std, group_n = {}, {}
    for name, mask in (groups or {}).items():
        r = resid[:, mask]
        group_std[name] = rms(r) if r.size else math.nan
        group_n[name] = int(r.size)
    return group_std, group_n


def noise_std_check(name: str, s: ReleaseStats, stated_std: float, crit: float) -> MeterCheck:
    """Release ``name``'s measured std over ``stated_std``, pooled (the z stated) and by group (the worst decides)."""
    pooled = ratio(s.std, stated_std)
    z = z_score(pooled - 1, s.std_se)
    worst, detail = z, []
    for g, gs in s.group_std.items():
        if s.group_n[g]:
            gz = z_score(ratio(gs, stated_std) - 1, 1 / math.sqrt(2 * s.group_n[g]))
            detail.append(f"{g} {ratio(gs, stated_std):.4f}")
            if abs(gz) > abs(worst):
                worst = gz
    return MeterCheck(
        "noise_std",
        name,
        pooled,
        1.0,
        z,
        abs(worst) <= crit,
        power_at(EFFECT, s.std_se, crit),
        "measured / stated std; by group: " + ", ".join(detail),
    )
