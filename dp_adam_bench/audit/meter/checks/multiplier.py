"""The ``multiplier`` check (joint): the noise multiplier of the joint release, (sum_r (Delta_r a_r / std_r)^2)^{-1/2},
with the measured stds and slopes and the sensitivities Delta_r the meter derives from the release's mean function
(C / B for g~; (2 B_max - 1) C^2 / B^2 for the square of the mean, B_max the largest batch seen), tested one-sided
against the noise multiplier the accountant used (``plan.account_sigma``): a mechanism noisier than accounted is no
privacy bug, one less noisy is. Power against a multiplier off by ``EFFECT``, from the propagated SEs."""

from __future__ import annotations

import math

from dp_adam_bench.audit.meter.checks.stats import EFFECT, power_at, z_score
from dp_adam_bench.audit.meter.result import MeterCheck


def multiplier_check(
    parts: list[tuple[float, float, float, float, float]], account_sigma: float, crit_one_sided: float
) -> MeterCheck:
    """``parts``: per release (sensitivity Delta, slope a, slope SE (relative), std, std SE (relative)). The joint
    noise multiplier (sum_r (Delta_r a_r / std_r)^2)^{-1/2} against the accountant's, one-sided."""
    if any(s <= 0 for _, _, _, s, _ in parts):  # a release without noise: no multiplier at all
        mult, se = 0.0, 0.0
    else:
        u = [(d * a / s) ** 2 for d, a, _, s, _ in parts]
        total = sum(u)
        mult = total**-0.5 if total > 0 else math.inf
        rel_u = [2 * math.hypot(sa / max(abs(a), 1e-300), ss) for _, a, sa, _, ss in parts]
        se = 0.5 * math.sqrt(sum((ui * ri) ** 2 for ui, ri in zip(u, rel_u, strict=True))) / total
    ratio = mult / account_sigma
    z = z_score(ratio - 1, se)
    return MeterCheck(
        "multiplier",
        "joint",
        ratio,
        1.0,
        z,
        z >= -crit_one_sided,
        power_at(EFFECT, se, crit_one_sided),
        f"measured {mult:.4g} / accounted {account_sigma:.4g} (one-sided: fails only below)",
    )
