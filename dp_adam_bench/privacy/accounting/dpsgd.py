"""Epsilon of DP-SGD (``steps`` Poisson-subsampled Gaussian steps, Abadi et al. 2016, arXiv:1607.00133,
Alg. 1) under one accountant or all of them."""

from __future__ import annotations

from dp_adam_bench.privacy.accounting.base import ACCOUNTANTS, AccountantFailure, get_accountant
from dp_adam_bench.privacy.accounting.checks import check_count, check_delta, check_q, check_sigma
from dp_adam_bench.privacy.accounting.events import PoissonGaussianEvent


def epsilon(sigma: float, q: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """Epsilon of ``steps`` Poisson-subsampled Gaussian steps at ``delta`` under ``accountant`` (a name in
    ``ACCOUNTANTS``: ``rdp``, ``prv`` (upper bound), ``pld``, or ``gdp_clt``, an approximation).

    Raises :class:`AccountantFailure` (a ValueError) with a one-line reason when the accountant cannot answer.
    """
    sigma, q, steps, delta = check_sigma(sigma), check_q(q), check_count(steps), check_delta(delta)
    return get_accountant(accountant).epsilon((PoissonGaussianEvent(sigma, q, steps),), delta)


def epsilons_with_errors(
    sigma: float, q: float, steps: int, delta: float
) -> tuple[dict[str, float], dict[str, str]]:
    """(epsilon of every accountant that answered, one-line reason of every one that failed)."""
    sigma, q, steps, delta = check_sigma(sigma), check_q(q), check_count(steps), check_delta(delta)
    values, errors = {}, {}
    for name in ACCOUNTANTS:
        try:
            values[name] = epsilon(sigma, q, steps, delta, name)
        except AccountantFailure as err:
            errors[name] = err.reason
    return values, errors


def epsilons(sigma: float, q: float, steps: int, delta: float) -> dict[str, float]:
    """:func:`epsilon` under every accountant in ``ACCOUNTANTS`` that answers (what Li et al. report beside
    RDP); :func:`epsilons_with_errors` also says why the others did not."""
    return epsilons_with_errors(sigma, q, steps, delta)[0]
