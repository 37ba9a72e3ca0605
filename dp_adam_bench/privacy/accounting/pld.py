"""``pld``: dp-accounting's privacy-loss-distribution accountant.

Koskela, Jalko & Honkela (2020), "Computing tight differential privacy guarantees using FFT",
arXiv:1906.03049; Doroshenko, Ghazi, Kamath, Kumar & Manurangsi (2022), "Connect the dots: tighter discrete
approximations of privacy loss distributions", arXiv:2207.04380. The pessimistic discretisation with interval
1e-4 (dp-accounting's default) is reported: an upper bound up to float error. :meth:`PldAccountant.bounds`
adds the optimistic discretisation (privacy buckets, dp-accounting has no optimistic connect-the-dots) as the
lower end; it is cruder, e.g. 0.1 below the reported 12.59 at sigma = 1, q = 0.04, 2000 steps.

Memory and time grow with the number of grid points, roughly (privacy-loss range) / interval. The range is
estimated before anything is built, from the single-step Gaussian (dp-accounting truncates it at tail mass
e^-50, about 10 standard deviations: (1 + 20 sigma) / sigma^2) and from the RDP epsilon at delta = 1e-15 (the
composed loss rarely exceeds it); past ``max_points`` the accountant refuses with that estimate as reason
(sigma = 0.05, q = 0.01, 150 steps needs 4e7 points, 3 GB and 35 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dp_adam_bench.privacy.accounting.base import Accountant
from dp_adam_bench.privacy.accounting.events import LedgerEvent, split
from dp_adam_bench.privacy.accounting.gaussian import gaussian_epsilon_unchecked
from dp_adam_bench.privacy.accounting.rdp import rdp_epsilon_from_vector, rdp_of

#: dp-accounting's default PLD discretisation interval; the value every reported ``pld`` epsilon uses.
PLD_DISCRETIZATION = 1e-4
#: Most grid points a PLD may have (about 80 bytes each at the peak of a composition).
PLD_MAX_POINTS = 2**24
_TAIL_STDS = 10.0  # sqrt(2 * 50): dp-accounting's log_mass_truncation_bound = -50


@lru_cache(maxsize=64)
def single_step_pld(sigma: float, q: float, discretization: float, pessimistic: bool = True):
    """dp-accounting PLD of one Poisson-subsampled Gaussian step (add-or-remove)."""
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma,
        sensitivity=1.0,
        sampling_prob=q,
        pessimistic_estimate=pessimistic,
        use_connect_dots=pessimistic,  # connect-the-dots is pessimistic only; privacy buckets otherwise
        value_discretization_interval=discretization,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )


@dataclass(frozen=True)
class PldAccountant(Accountant):
    """dp-accounting PLD (see the module docstring). Only Gaussian events: exact (one Gaussian)."""

    discretization: float = PLD_DISCRETIZATION
    max_points: int = PLD_MAX_POINTS

    name = "pld"
    label = "dp-accounting PLD"
    guarantee = True

    def estimated_points(self, events: tuple[LedgerEvent, ...]) -> float:
        """Grid points the composition is expected to need (see the module docstring)."""
        poisson, mu_sq = split(events)
        sigmas = [e.sigma for e in poisson] + ([1.0 / math.sqrt(mu_sq)] if mu_sq > 0 else [])
        single = max((1.0 + 2 * _TAIL_STDS * s) / s**2 for s in sigmas)
        composed = 2 * rdp_epsilon_from_vector(rdp_of(events), 1e-15)
        return max(single, composed) / self.discretization

    def _pld(self, events: tuple[LedgerEvent, ...], pessimistic: bool):
        points = self.estimated_points(events)
        if not points <= self.max_points:
            raise self.fail(
                f"the PLD grid would need about {points:.3g} points (interval {self.discretization:g}), over the "
                f"cap of {self.max_points}: the privacy loss is far too spread out for this grid (noise "
                "multiplier too small for these events)"
            )
        poisson, mu_sq = split(events)
        pld = None
        for e in poisson:
            part = single_step_pld(e.sigma, e.q, self.discretization, pessimistic).self_compose(e.count)
            pld = part if pld is None else pld.compose(part)
        if mu_sq > 0:
            pld = pld.compose(
                pld_lib.from_gaussian_mechanism(
                    standard_deviation=1.0 / math.sqrt(mu_sq),
                    sensitivity=1.0,
                    pessimistic_estimate=pessimistic,
                    use_connect_dots=pessimistic,
                    value_discretization_interval=self.discretization,
                    neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                )
            )
        return pld

    def _epsilon(self, events: tuple[LedgerEvent, ...], delta: float) -> float:
        poisson, mu_sq = split(events)
        if not poisson:
            return gaussian_epsilon_unchecked(math.sqrt(mu_sq), delta)
        return float(self._pld(events, pessimistic=True).get_epsilon_for_delta(delta))

    def _bounds(self, events: tuple[LedgerEvent, ...], delta: float) -> tuple[float, float]:
        poisson, _ = split(events)
        upper = max(self._epsilon(events, delta), 0.0)
        if not poisson:
            return upper, upper
        lower = float(self._pld(events, pessimistic=False).get_epsilon_for_delta(delta))
        return min(max(lower, 0.0), upper), upper
