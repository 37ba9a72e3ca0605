"""Privacy accounting for DP-SGD-style training and DP-MF releases, behind one interface.

Thin wrappers around the libraries, never a re-derivation; one :class:`~.base.Accountant` class per method,
registered in :data:`ACCOUNTANTS` (``"rdp" in ACCOUNTANTS``, ``ACCOUNTANTS.get("prv")`` is the class):

* ``rdp`` (:mod:`.rdp`) — Opacus' RDP accountant; an upper bound.
* ``prv`` (:mod:`.prv`) — Opacus' PRV accountant (Gopi, Lee & Wutschitz 2021, arXiv:2106.02848); reports the
  upper end of its error band (Opacus' ``get_epsilon``), the central estimate stays available.
* ``pld`` (:mod:`.pld`) — dp-accounting's PLD accountant, pessimistic discretisation 1e-4; an upper bound.
* ``gdp_clt`` (:mod:`.gdp_clt`) — Gaussian DP through the central limit theorem (Bu et al. 2020,
  arXiv:1911.11607). **An approximation, not a guarantee** (``guarantee = False``): reported, never used for
  calibration or budgets.

All use the add-or-remove-one neighbouring relation with Poisson sampling at rate q, unit sensitivity and
noise multiplier sigma (noise std sigma * C on the clipped sum). :class:`PrivacyLedger` (:mod:`.ledger`)
records what a run released; :func:`calibrate_sigma` and :func:`steps_to_epsilon` (:mod:`.calibration`) turn a
target into sigma or a number of steps; :mod:`.gaussian` holds the exact Gaussian mechanism.
"""

from __future__ import annotations

from dp_adam_bench.privacy.accounting.base import (
    ACCOUNTANTS,
    Accountant,
    AccountantFailure,
    cached_epsilon,
    get_accountant,
    get_guarantee_accountant,
    guarantee_names,
)
from dp_adam_bench.privacy.accounting.calibration import calibrate_sigma, steps_to_epsilon
from dp_adam_bench.privacy.accounting.dpsgd import epsilon, epsilons, epsilons_with_errors
from dp_adam_bench.privacy.accounting.events import GaussianEvent, LedgerEvent, PoissonGaussianEvent
from dp_adam_bench.privacy.accounting.gaussian import (
    gaussian_delta,
    gaussian_epsilon,
    gaussian_mu,
    mf_epsilon,
)
from dp_adam_bench.privacy.accounting.gdp_clt import GdpCltAccountant, gdp_clt_mu
from dp_adam_bench.privacy.accounting.ledger import LEDGER_FORMAT, LEDGER_VERSION, PrivacyLedger
from dp_adam_bench.privacy.accounting.pld import (
    PLD_DISCRETIZATION,
    PLD_MAX_POINTS,
    PldAccountant,
    single_step_pld,
)
from dp_adam_bench.privacy.accounting.prv import PRV_EPS_ERROR, PRV_MAX_POINTS, PrvAccountant, prv_triple
from dp_adam_bench.privacy.accounting.rdp import RDP_ORDERS, RdpAccountant, rdp_vector


def clear_caches() -> None:
    """Forget every cached epsilon and grid (benchmarks time cold calls)."""
    cached_epsilon.cache_clear()
    prv_triple.cache_clear()
    rdp_vector.cache_clear()
    single_step_pld.cache_clear()


__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "AccountantFailure",
    "GaussianEvent",
    "GdpCltAccountant",
    "LEDGER_FORMAT",
    "LEDGER_VERSION",
    "LedgerEvent",
    "PLD_DISCRETIZATION",
    "PLD_MAX_POINTS",
    "PRV_EPS_ERROR",
    "PRV_MAX_POINTS",
    "PldAccountant",
    "PoissonGaussianEvent",
    "PrivacyLedger",
    "PrvAccountant",
    "RDP_ORDERS",
    "RdpAccountant",
    "calibrate_sigma",
    "clear_caches",
    "epsilon",
    "epsilons",
    "epsilons_with_errors",
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_mu",
    "gdp_clt_mu",
    "get_accountant",
    "get_guarantee_accountant",
    "guarantee_names",
    "mf_epsilon",
    "steps_to_epsilon",
]
