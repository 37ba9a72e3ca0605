"""``prv``: Opacus' PRV accountant (Gopi, Lee & Wutschitz 2021, "Numerical composition of differential
privacy", arXiv:2106.02848), what Li et al. (2022, arXiv:2110.05679) call "composing trade-off functions".

The PRV accountant returns three numbers: a central *estimate* and an interval [lower, upper] that contains
the true epsilon (Gopi et al. Thm. 5.5; ``upper`` = epsilon at delta - delta_error, plus ``eps_error``).
**The reported epsilon is ``upper``**, as Opacus' own ``PRVAccountant.get_epsilon`` returns: the estimate may
exceed the true epsilon, and a value that calibrates noise or enforces a budget must be a bound (calibrating
to the estimate overshot the target by 0.006-0.011 above Opacus' bound in 9 of 9 settings tried). The
estimate stays available through :meth:`PrvAccountant.estimate` and :meth:`PrvAccountant.bounds`.

The grid is built from the public ``opacus.accountants.analysis.prv`` functions exactly as
``PRVAccountant._get_dprv`` does (domain from Gopi et al. Remark 5.6, mesh eps_error / sqrt(T log(12 /
delta_error) / 2), truncation, discretisation, FFT composition), so that the number of grid points 2 L / mesh
is known *before* any array is allocated; past ``max_points`` the accountant refuses with that size as reason
(sigma = 0.001, q = 0.01, 150 steps would have allocated 4.73 TiB).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from opacus.accountants.analysis import prv as prv_lib

from dp_adam_bench.privacy.accounting.base import Accountant
from dp_adam_bench.privacy.accounting.checks import check_delta
from dp_adam_bench.privacy.accounting.events import LedgerEvent, compact, split
from dp_adam_bench.privacy.accounting.gaussian import gaussian_epsilon_unchecked

#: Opacus' default ``eps_error`` of ``PRVAccountant.get_epsilon`` (mesh and truncation of the PRV domain).
PRV_EPS_ERROR = 0.01
#: Most grid points a PRV may have (about 80 bytes each while discretising and composing).
PRV_MAX_POINTS = 2**24


@dataclass(frozen=True)
class PrvAccountant(Accountant):
    """Opacus PRV (see the module docstring): reports the upper end of Opacus' error band."""

    eps_error: float = PRV_EPS_ERROR
    max_points: int = PRV_MAX_POINTS

    name = "prv"
    label = "Opacus PRV (upper bound)"
    guarantee = True

    def estimate(self, events, delta: float) -> float:
        """The central estimate (not a bound: the true epsilon may be below or above it)."""
        events, delta = compact(events), check_delta(delta)
        if not events:
            return 0.0
        return max(self._guarded(prv_triple, self, events, delta)[1], 0.0)

    def _epsilon(self, events: tuple[LedgerEvent, ...], delta: float) -> float:
        return prv_triple(self, events, delta)[2]

    def _bounds(self, events: tuple[LedgerEvent, ...], delta: float) -> tuple[float, float]:
        lower, _, upper = prv_triple(self, events, delta)
        return max(lower, 0.0), max(upper, 0.0)

    def grid_points(
        self, history: list[tuple[float, float, int]], delta: float
    ) -> tuple[float, float, float]:
        """(domain half-width L, mesh, number of points 2 L / mesh) Opacus would use for this history."""
        delta_error = delta / 1000  # Opacus' default
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            prvs = [prv_lib.PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
            size = float(
                prv_lib.compute_safe_domain_size(
                    prvs=prvs,
                    max_self_compositions=[n for _, _, n in history],
                    eps_error=self.eps_error,
                    delta_error=delta_error,
                )
            )
        mesh = self.eps_error / math.sqrt(sum(n for _, _, n in history) * math.log(12 / delta_error) / 2)
        return size, mesh, 2 * size / mesh


@lru_cache(maxsize=1024)
def prv_triple(
    acc: PrvAccountant, events: tuple[LedgerEvent, ...], delta: float
) -> tuple[float, float, float]:
    """(lower, estimate, upper) of Opacus' PRV accountant for the events."""
    poisson, mu_sq = split(events)
    if not poisson:
        exact = gaussian_epsilon_unchecked(math.sqrt(mu_sq), delta)
        return exact, exact, exact
    history = [(e.sigma, e.q, e.count) for e in poisson]
    if mu_sq > 0:
        history.append((1.0 / math.sqrt(mu_sq), 1.0, 1))  # a Gaussian is the PRV with q = 1
    size, mesh, points = acc.grid_points(history, delta)
    if not points <= acc.max_points:
        raise acc.fail(
            f"the PRV grid would need {points:.3g} points (domain +-{size:.3g}, mesh {mesh:.3g}), over the cap "
            f"of {acc.max_points}: the privacy loss is too spread out (noise multiplier too small) or the run "
            "too long for this eps_error"
        )
    delta_error = delta / 1000
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        prvs = [prv_lib.PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
        domain = prv_lib.Domain.create_aligned(-size, size, mesh)
        dprvs = [
            prv_lib.discretize(prv_lib.TruncatedPrivacyRandomVariable(p, domain.t_min, domain.t_max), domain)
            for p in prvs
        ]
        composed = prv_lib.compose_heterogeneous(
            dprvs=dprvs, num_self_compositions=[n for _, _, n in history]
        )
        lower, estimate, upper = composed.compute_epsilon(delta, delta_error, acc.eps_error)
    return float(lower), float(estimate), float(upper)
