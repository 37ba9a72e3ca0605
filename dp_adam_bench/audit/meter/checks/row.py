"""Every check of one meter row, in the row's order: ``sampling``, ``multiplier``, then for each release (g~, and
IME's g^2) ``sensitivity``, ``noise_std`` and ``correlation``, then ``noise_covariance`` (the runners append
``post_processing``, replay.py). Each statistical check is a z- or chi-square test at level ALPHA / (number of
checks): a union bound, so that a correct mechanism fails any check of a row with probability <= ALPHA."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dp_adam_bench.audit.meter.checks.multiplier import multiplier_check
from dp_adam_bench.audit.meter.checks.noise_covariance import joint_noise_check
from dp_adam_bench.audit.meter.checks.release import release_checks, release_stats
from dp_adam_bench.audit.meter.checks.sampling import sampling_check
from dp_adam_bench.audit.meter.checks.stats import critical
from dp_adam_bench.audit.meter.result import MeterCheck


@dataclass
class Release:
    """One release of a run beside the meter's prediction of it."""

    name: str  # "g" or "g^2"
    y: (
        np.ndarray
    )  # the release, (steps, coordinates) (in the clipping geometry: s_t g~_t for scale-then-privatize)
    x: np.ndarray  # its predicted mean, the same shape
    stated_std: float  # the noise std the privatizer states
    sensitivity: float  # Delta: the meter's own sensitivity of the release's mean function
    classes: dict[str, np.ndarray] | None = None  # norm class -> coordinates (the slope by class)


def row_checks(
    records,
    population: np.ndarray,
    sampler,
    n: int,
    releases: list[Release],
    strategy: np.ndarray | None,
    groups: dict[str, np.ndarray],
    account_sigma: float,
    alpha: float,
) -> list[MeterCheck]:
    """The checks of a run's ``records`` (drawn by ``sampler`` from ``population`` of the task's ``n`` examples)
    and ``releases`` (whitened by ``strategy``, the noise std by coordinate ``groups``), the multiplier against
    ``account_sigma``; all but post-processing, which counts in the level."""
    count = 4 + 3 * len(releases)  # sampling, multiplier, noise covariance, post-processing + 3 per release
    crit = critical(alpha, count)
    checks = [sampling_check(records, population, sampler, n, crit)]
    parts, whitened = [], []
    for r in releases:
        s = release_stats(r.y, r.x, strategy, groups, r.classes)
        checks += release_checks(r.name, s, r.stated_std, crit)
        parts.append((r.sensitivity, s.slope, s.slope_se, s.std, s.std_se))
        whitened.append((r.name, s.resid))
    checks.insert(1, multiplier_check(parts, account_sigma, critical(alpha, count, two_sided=False)))
    checks.append(joint_noise_check(whitened, alpha / count))
    return checks
