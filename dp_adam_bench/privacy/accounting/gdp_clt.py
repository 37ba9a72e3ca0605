"""``gdp_clt``: mu-GDP through the central limit theorem — an approximation, not a guarantee.

Bu, Dong, Long & Su (2020), "Deep learning with Gaussian differential privacy", arXiv:1911.11607, Thm. 2 /
Opacus ``compute_mu_poisson``: T Poisson-subsampled Gaussian steps are approximately mu-GDP with
mu = q sqrt(T (e^{1/sigma^2} - 1)); Gaussian events add mu^2 exactly (Dong, Roth & Su 2022, arXiv:1905.02383,
Cor. 3.3); then the exact mu-GDP -> (eps, delta) dual (ibid., Cor. 2.13). The CLT is asymptotic (T -> inf,
q sqrt(T) fixed) and can fall *below* the exact PLD value (docs/pitfalls.md, "Accounting"), so it is for
reporting beside the others (what Li et al. 2022, arXiv:2110.05679, report), never for calibration or budgets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dp_adam_bench.privacy.accounting.base import Accountant
from dp_adam_bench.privacy.accounting.checks import check_count, check_q, check_sigma
from dp_adam_bench.privacy.accounting.events import LedgerEvent, split
from dp_adam_bench.privacy.accounting.gaussian import gaussian_epsilon_unchecked


def gdp_clt_mu_unchecked(sigma: float, q: float, steps: float) -> float:
    # expm1 keeps precision for large sigma; inf for tiny sigma means no privacy under the CLT.
    with np.errstate(over="ignore"):
        growth = float(np.expm1(1.0 / sigma**2))
    return q * math.sqrt(steps * growth)


def gdp_clt_mu(sigma: float, q: float, steps: int) -> float:
    """mu of T Poisson-subsampled Gaussian steps under the GDP central limit theorem.

    Bu, Dong, Long & Su (2020), Thm. 2 / Opacus ``compute_mu_poisson``: mu = q sqrt(T (e^{1/sigma^2} - 1)).
    An asymptotic approximation (T -> infinity, q sqrt(T) fixed), not a bound.
    """
    sigma, q, steps = check_sigma(sigma), check_q(q), check_count(steps)
    return gdp_clt_mu_unchecked(sigma, q, steps)


@dataclass(frozen=True)
class GdpCltAccountant(Accountant):
    """GDP + CLT (see the module docstring): ``guarantee`` False; ``bounds`` (0, inf) when DP-SGD steps are
    involved, exact when only Gaussian events are."""

    name = "gdp_clt"
    label = "GDP central limit theorem (approximation)"
    guarantee = False

    def _mu(self, events: tuple[LedgerEvent, ...]) -> float:
        poisson, mu_sq = split(events)
        mu_sq += math.fsum(gdp_clt_mu_unchecked(e.sigma, e.q, e.count) ** 2 for e in poisson)
        return math.sqrt(mu_sq)

    def _epsilon(self, events: tuple[LedgerEvent, ...], delta: float) -> float:
        mu = self._mu(events)
        return gaussian_epsilon_unchecked(mu, delta) if math.isfinite(mu) else math.inf

    def _bounds(self, events: tuple[LedgerEvent, ...], delta: float) -> tuple[float, float]:
        poisson, _ = split(events)
        if poisson:
            return 0.0, math.inf
        value = self._epsilon(events, delta)
        return value, value
