"""Accounting of correlated noise (DP-MF) under sampling: amplified BandMF, and stated bounds for the rest.

**Amplified BandMF** (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu 2023, "(Amplified) banded
matrix factorization: a unified approach to private training", arXiv:2306.08153, Thm. 4). Split the N examples
into b groups and let step t sample group t mod b by Poisson sampling with probability q = b B / N (cyclic
Poisson, :class:`~dp_adam_bench.engine.sampling.CyclicPoissonSampler`). If C is lower triangular and
``bands``-banded with bands <= b, the columns an example can touch (steps of one residue class mod b) have
disjoint row supports, so the release C x + z splits into independent pieces, one per participation
opportunity, each a Poisson-subsampled Gaussian with noise multiplier sigma / (max column norm of C). An
n-step run is therefore exactly as private as DP-SGD with sampling rate q for ceil(n / b) steps (the group of
step 0 has that many opportunities), accounted here with the run's accountant (dp-accounting PLD, Opacus RDP,
PRV). The strategies of :mod:`dp_adam_bench.privacy.strategies` have unit max column norm, so sigma is
unchanged; DP-SGD (C = I) is the case bands = 1 with any b.

**Every other strategy under cyclic Poisson, and balls-in-bins batches** get the stated, conservative bound:
no amplification credit. An example can participate at most k = ceil(n / b) times, at least b steps apart (cyclic
Poisson: only at its group's steps; balls-in-bins: exactly at the steps of its bin, Choquette-Choo et al. 2024,
"Near exact privacy amplification for matrix mechanisms", arXiv:2410.06266), so the whole stream is a Gaussian
mechanism with the k-participation, b-separated sensitivity of C (Choquette-Choo et al. 2022, "Multi-epoch
matrix factorization mechanisms", arXiv:2211.06530) — an upper bound on epsilon whatever the sampling adds.
Tighter amplified accounting for non-banded C exists (MMCC: Choquette-Choo, Ganesh, Steinke & Thakurta 2024,
"Privacy amplification for matrix mechanisms", arXiv:2310.15526; the Monte Carlo accounting of
arXiv:2410.06266 for balls-in-bins) and is not implemented here: :data:`NOT_IMPLEMENTED` says so in every note.
"""

from __future__ import annotations

import math

import numpy as np

from dp_adam_bench.privacy.accounting.calibration import calibrate_sigma, steps_to_epsilon
from dp_adam_bench.privacy.accounting.checks import check_count, check_delta, check_q, check_sigma
from dp_adam_bench.privacy.accounting.events import GaussianEvent, PoissonGaussianEvent
from dp_adam_bench.privacy.accounting.gaussian import gaussian_mu, mf_epsilon

#: what a conservative (non-amplified) bound leaves out, for notes and errors
NOT_IMPLEMENTED = (
    "amplified accounting of non-banded strategies (MMCC, Choquette-Choo et al. 2024, arXiv:2310.15526) and "
    "Monte Carlo accounting of balls-in-bins (Choquette-Choo et al. 2024, arXiv:2410.06266) are not implemented"
)
AMPLIFIED_BANDMF = "Choquette-Choo et al. 2023, arXiv:2306.08153, Thm. 4"


def strategy_bands(strategy) -> int:
    """Number of bands of a lower-triangular C: 1 + the largest t - s with C[t, s] != 0 (C = I: 1)."""
    bands = getattr(strategy, "bands", None)
    if bands is not None:
        return int(bands)
    if getattr(strategy, "name", "") == "independent":
        return 1
    coefs = getattr(strategy, "coefs", None)
    if coefs is not None and hasattr(strategy, "inverse_coefficients"):  # Toeplitz: the first column decides
        nonzero = np.flatnonzero(np.asarray(coefs)[: strategy.n])
        return int(nonzero[-1]) + 1 if len(nonzero) else 1
    c = strategy.matrix()
    rows, cols = np.nonzero(c)
    return int(np.max(rows - cols)) + 1 if len(rows) else 1


def rounds(steps: int, cycle_length: int) -> int:
    """Participation opportunities of the worst-off group in ``steps`` steps of cycle length b: ceil(n / b)."""
    steps, cycle_length = check_count(steps, "steps"), check_count(cycle_length, "cycle_length")
    return -(-steps // cycle_length)


def amplifies(strategy, cycle_length: int) -> bool:
    """Whether :func:`amplified_bandmf_event` applies: C is banded with bands <= the cycle length."""
    return strategy_bands(strategy) <= int(cycle_length)


def check_amplifiable(strategy, cycle_length: int, field: str = "train.cycle_length") -> None:
    """ValueError naming the paper when C is banded but wider than the cycle (the theorem needs bands <= b)."""
    bands = strategy_bands(strategy)
    if bands > int(cycle_length):
        raise ValueError(
            f"{field}={cycle_length} is smaller than the strategy's {bands} bands: amplified BandMF "
            f"({AMPLIFIED_BANDMF}) needs a b-banded C with b <= the cycle length; set {field} >= {bands}"
        )


def amplified_bandmf_event(
    sigma: float, q: float, steps: int, cycle_length: int, column_norm: float = 1.0
) -> PoissonGaussianEvent:
    """The DP-SGD event equivalent to ``steps`` steps of amplified BandMF: ceil(steps / b) Poisson-subsampled
    Gaussian steps at rate q, noise multiplier sigma / column_norm (:data:`AMPLIFIED_BANDMF`)."""
    sigma, q = check_sigma(sigma), check_q(q)
    return PoissonGaussianEvent(sigma / float(column_norm), q, rounds(steps, cycle_length))


def amplified_bandmf_epsilon(
    sigma: float,
    q: float,
    steps: int,
    cycle_length: int,
    delta: float,
    accountant: str = "pld",
    column_norm: float = 1.0,
) -> float:
    """Epsilon at ``delta`` of ``steps`` steps of amplified BandMF (see :func:`amplified_bandmf_event`)."""
    from dp_adam_bench.privacy.accounting.base import get_accountant

    event = amplified_bandmf_event(sigma, q, steps, cycle_length, column_norm)
    return get_accountant(accountant).epsilon((event,), check_delta(delta))


def calibrate_amplified_sigma(
    target_epsilon: float,
    delta: float,
    q: float,
    steps: int,
    cycle_length: int,
    accountant: str = "rdp",
    column_norm: float = 1.0,
) -> float:
    """The noise multiplier sigma with which ``steps`` steps of amplified BandMF reach ``target_epsilon``: the
    DP-SGD sigma for ceil(steps / b) steps at rate q, times the max column norm of C."""
    return float(column_norm) * calibrate_sigma(
        target_epsilon, delta, q, rounds(steps, cycle_length), accountant
    )


def amplified_steps_to_epsilon(
    target_epsilon: float,
    sigma: float,
    q: float,
    cycle_length: int,
    delta: float,
    accountant: str = "rdp",
    column_norm: float = 1.0,
) -> int:
    """The most steps of amplified BandMF within ``target_epsilon``: b times the most DP-SGD rounds (a step
    t costs a round only when it opens a cycle, so every t <= rounds * b costs at most ``rounds``)."""
    allowed = steps_to_epsilon(target_epsilon, sigma / float(column_norm), q, delta, accountant)
    return allowed * int(cycle_length)


# --- the conservative bound: a Gaussian mechanism over b-separated participations -------------------------------
def separated_sensitivity(strategy, steps: int, cycle_length: int) -> float:
    """Sensitivity of C when an example participates at most ceil(steps / b) times, at least b steps apart."""
    k = rounds(steps, cycle_length)
    return float(strategy.sensitivity(participations=k, min_separation=int(cycle_length) if k > 1 else None))


def conservative_event(sigma: float, strategy, steps: int, cycle_length: int) -> GaussianEvent:
    """The whole stream as one Gaussian mechanism with mu = sensitivity / sigma (no amplification credit)."""
    return GaussianEvent(separated_sensitivity(strategy, steps, cycle_length) / check_sigma(sigma))


def conservative_epsilon(sigma: float, strategy, steps: int, cycle_length: int, delta: float) -> float:
    return mf_epsilon(check_sigma(sigma), separated_sensitivity(strategy, steps, cycle_length), delta)


def calibrate_gaussian_sigma(target_epsilon: float, delta: float, sensitivity: float) -> float:
    """Sigma of a Gaussian mechanism with this sensitivity at exactly (target_epsilon, delta): sensitivity / mu
    (Balle & Wang 2018, arXiv:1805.06530, Alg. 1)."""
    mu = gaussian_mu(target_epsilon, delta)
    sigma = float(sensitivity) / mu
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(
            f"no finite sigma > 0 reaches epsilon {target_epsilon!r} (sensitivity {sensitivity!r})"
        )
    return sigma


def equivalent_dpsgd_sigma(strategy, sigma: float) -> float:
    """The DP-SGD noise multiplier with the same prefix-sum RMSE as ``strategy`` at ``sigma``:
    sigma * rmse(C) / rmse(I) (Ganesh, McMahan & Thakurta 2025, arXiv:2507.01129, §5.2)."""
    from dp_adam_bench.privacy.strategies import IdentityStrategy

    return float(sigma) * strategy.prefix_rmse() / IdentityStrategy(strategy.n).prefix_rmse()
