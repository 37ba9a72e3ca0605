"""``rdp``: Opacus' RDP accountant for the Poisson-subsampled Gaussian.

RDP of one step from Mironov, Talwar & Zhang (2019), "Renyi differential privacy of the sampled Gaussian
mechanism", arXiv:1908.10530, over Opacus' default orders; RDP adds up under composition (Mironov 2017,
arXiv:1702.07476, Prop. 1), a non-amplified Gaussian with mu contributes alpha mu^2 / 2 (ibid., Prop. 7); the
conversion to (eps, delta) is Opacus' (Balle et al. 2020, "Hypothesis testing interpretations and Renyi
differential privacy", arXiv:1905.09982, Thm. 21; the same as Canonne, Kamath & Steinke 2020, Prop. 12). An
upper bound, typically looser than ``pld``/``prv``; O(number of orders) time and memory whatever the events.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from opacus.accountants import RDPAccountant as _OpacusRDP
from opacus.accountants.analysis import rdp as rdp_lib

from dp_adam_bench.privacy.accounting.base import Accountant
from dp_adam_bench.privacy.accounting.events import LedgerEvent, split

#: Opacus' default RDP orders (``RDPAccountant.DEFAULT_ALPHAS``; private-transformers uses the same list).
RDP_ORDERS: tuple[float, ...] = tuple(float(a) for a in _OpacusRDP.DEFAULT_ALPHAS)


@lru_cache(maxsize=4096)
def rdp_vector(sigma: float, q: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step at :data:`RDP_ORDERS` (linear in the number of steps)."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        vec = rdp_lib.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(RDP_ORDERS))
    vec = np.asarray(vec, dtype=float)
    vec.setflags(write=False)
    return vec


def rdp_epsilon_from_vector(rdp: np.ndarray, delta: float) -> float:
    """Opacus' RDP -> (eps, delta) conversion over :data:`RDP_ORDERS`."""
    with warnings.catch_warnings():
        # Opacus warns when the optimum is the largest/smallest order; the bound stays valid, only looser.
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = rdp_lib.get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)
    return max(float(eps), 0.0)


def rdp_of(events: tuple[LedgerEvent, ...]) -> np.ndarray:
    """The RDP curve of the composed events at :data:`RDP_ORDERS`."""
    poisson, mu_sq = split(events)
    rdp = sum((e.count * rdp_vector(e.sigma, e.q) for e in poisson), np.zeros(len(RDP_ORDERS)))
    return rdp + np.asarray(RDP_ORDERS) * mu_sq / 2


@dataclass(frozen=True)
class RdpAccountant(Accountant):
    """Opacus RDP (see the module docstring). ``bounds`` is (0, value): an upper bound whose slack is not
    computed (compare ``pld``)."""

    name = "rdp"
    label = "Opacus RDP"
    guarantee = True

    def _epsilon(self, events: tuple[LedgerEvent, ...], delta: float) -> float:
        return rdp_epsilon_from_vector(rdp_of(events), delta)
