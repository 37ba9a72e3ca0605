"""The noise a run actually added, reconciled at every step with the noise multiplier its privacy ledger records
(issue 44).

The privacy ledger records, per Poisson-subsampled round, a noise multiplier z (the plan's ``account_sigma``
divided by the strategy's column norm); the participation ledger (:mod:`dp_adam_bench.engine.participation`) checks
the rounds, the rate and the sensitivity, but never the size of the noise, and the mechanism meter compares its
measurement with ``plan.account_sigma``: a slip in ``account_sigma`` or in a column norm changes the ledger and the
meter's reference together (planted: the column norm halved, and a run reported epsilon 0.586 instead of 1.460 with
every check "consistent"). This check reads neither. It measures the multiplier from the noise tensors the
privatizer added, and derives the strategy's geometry itself:

* **measured**, each step: the sum of squares of every noise tensor the privatizer added to a release (float64,
  over all coordinates), divided by that release's per-example sensitivity on the averaged scale (C / B for the
  gradient, S2 for g^2: the variant's formula) and by the row variance of C^{-1} at this step, gives k^2 sigma^2
  (k the releases' noise scale); pooled over the R releases of the step, z_meas = k sigma / (max column norm of
  C x sqrt(R)), the joint noise multiplier of the step's releases (R Gaussian mechanisms with multiplier k sigma
  each compose to k sigma / sqrt R).
* **geometry by brute force**: C's max column norm and C^{-1}'s row variances from the strategy's matrices
  (``matrix()``, ``inverse_matrix()``, up to :data:`BRUTE_FORCE_STEPS` steps), not from the strategy's own
  ``max_column_norm`` / ``row_variance`` or the plan's ``column_norm``. Longer streams of a correlated strategy use
  the strategy's own formulas and the record says so; independent noise (C = I) needs none.
* **against the ledger**, each step: under Poisson-type accounting (DP-SGD, amplified BandMF) the multiplier z of
  the round the ledger holds for this step must explain the measurement: n (z_meas / z)^2 is chi-square with n
  degrees of freedom for n coordinates, tested two-sided at false alarm :data:`FALSE_ALARM` on this step's draws
  and on all steps' so far (a small model's step has little power alone); a mismatch stops the run before its
  next release
  (:class:`~dp_adam_bench.errors.PrivacyMismatch`). Non-amplified runs record one Gaussian mechanism up front with
  mu = sensitivity / z; its reconciliation is the participation ledger's sensitivity check, which is given z_meas
  (pooled over every step) in place of the plan's multiplier.

What it cannot see: a sensitivity formula that is wrong in the variant itself (S2 of g^2: the meter's sensitivity
check), noise that is added and then removed later in the step, correlations between steps or streams (the meter's
covariance checks), and, in a data-parallel run, ranks other than 0 (rank 0 draws and broadcasts the noise).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

#: streams longer than this keep the strategy's own column norm and row variances (an n x n matrix is 128 MB here)
BRUTE_FORCE_STEPS = 4096
#: standard deviations of the estimate allowed in :func:`tolerance` (a relative slack for a pooled estimate)
SIGMAS = 6.0
#: two-sided false-alarm probability of each per-step test under honest Gaussian noise
FALSE_ALARM = 1e-10


@functools.lru_cache(maxsize=256)
def acceptance(coordinates: int) -> tuple[float, float]:
    """The range of n (z_meas / z)^2 ~ chi-square(n) accepted for n = ``coordinates`` squared Gaussian draws
    (exact for any n, where a normal approximation would misfire on a 2-parameter toy)."""
    from scipy.stats import chi2

    return float(chi2.ppf(FALSE_ALARM / 2, coordinates)), float(chi2.isf(FALSE_ALARM / 2, coordinates))


def tolerance(coordinates: int) -> float:
    """Relative tolerance of a multiplier estimated from ``coordinates`` squared Gaussian draws: the estimate of
    sigma has relative standard deviation 1 / sqrt(2 n); :data:`SIGMAS` of them, and at least 1e-6 (float32)."""
    return SIGMAS / math.sqrt(2 * max(coordinates, 1)) + 1e-6


def strategy_geometry(strategy, steps: int) -> tuple[float, np.ndarray | None, bool]:
    """(max column norm of C, row variances of C^{-1} for every step or None for C = I, brute_force)."""
    if strategy is None or getattr(strategy, "name", "") == "independent":
        return 1.0, None, True
    if steps <= BRUTE_FORCE_STEPS:
        c = np.asarray(strategy.matrix(), dtype=np.float64)
        inv = np.linalg.inv(c)
        return float(np.sqrt((c**2).sum(0).max())), (inv**2).sum(1), True
    return float(strategy.max_column_norm()), np.asarray(strategy.row_variance(), dtype=np.float64), False


class NoiseCheck:
    """What the privatizer added (:meth:`observe`, one call per release) against the privacy ledger
    (:meth:`check_step`). ``sensitivities``: each stream's per-example sensitivity on the averaged scale."""

    def __init__(self, strategy, steps: int, sensitivities: list[float]):
        self.col_norm, self.row_var, self.brute_force = strategy_geometry(strategy, steps)
        self.sens = [float(s) for s in sensitivities]
        self.streams = len(self.sens)
        self._ss = 0.0  # this step's sum over releases of (added^2 / (sens^2 var_t))
        self._n = 0  # this step's coordinates
        self.total_ss = 0.0  # over every step checked
        self.total_n = 0
        self.steps = 0
        self.worst = 0.0  # largest |z_meas / z_ledger - 1| over the steps checked
        self.worst_tolerance = 0.0
        #: the first step's mismatch (a line), None while every step matched
        self.mismatch: str | None = None
        #: raise at the first mismatch (``train.noise_check=stop``, the default); ``record`` keeps going and the
        #: participation ledger's ``noise`` check fails the run at its end (the audits, which must see the rest)
        self.stop = True

    def variance(self, t: int) -> float:
        """Row variance of C^{-1} at 0-based step ``t`` (1 for independent noise)."""
        return 1.0 if self.row_var is None else float(self.row_var[min(t, len(self.row_var) - 1)])

    def observe(self, stream: int, added: list[torch.Tensor], t: int) -> None:
        """The noise tensors ``added`` to release ``stream`` at 0-based step ``t`` (as added: after any scale)."""
        ss = sum(float(torch.linalg.vector_norm(a, dtype=torch.float64) ** 2) for a in added)
        n = sum(a.numel() for a in added)
        self._ss += ss / (self.sens[stream] ** 2 * self.variance(t))
        self._n += n

    def multiplier(self, ss: float, n: int) -> float:
        """z_meas from a pooled sum of normalised squares over ``n`` coordinates (module docstring)."""
        return math.sqrt(ss / n) / (self.col_norm * math.sqrt(self.streams)) if n else math.nan

    @property
    def pooled(self) -> float:
        """z_meas over every step observed (nan before the first)."""
        return self.multiplier(self.total_ss, self.total_n)

    def check_step(self, plan, ledger, step: int) -> None:
        """After step ``step``'s releases: the ledger's multiplier for its round against this step's
        measurement; :class:`PrivacyMismatch` beyond :func:`tolerance`. Non-amplified accounting is checked at
        the end by the participation ledger (module docstring)."""
        from dp_adam_bench.errors import PrivacyMismatch
        from dp_adam_bench.privacy.accounting.events import PoissonGaussianEvent

        ss, n = self._ss, self._n
        self._ss, self._n = 0.0, 0
        if not n:
            return
        self.total_ss += ss
        self.total_n += n
        self.steps += 1
        rounds = [e for e in ledger.events if isinstance(e, PoissonGaussianEvent)]
        if not rounds:
            return
        recorded = float(rounds[-1].sigma)
        # this step's draws, then every step's so far (each round has the same multiplier): the pooled test gains
        # the power a small model's step lacks
        for what, s_, n_ in (("this step", ss, n), ("every step so far", self.total_ss, self.total_n)):
            z = self.multiplier(s_, n_)
            lo, hi = acceptance(n_)
            stat = n_ * (z / recorded) ** 2 if recorded > 0 else math.inf
            gap = abs(z / recorded - 1) if recorded > 0 else math.inf
            tol = max(1 - math.sqrt(lo / n_), math.sqrt(hi / n_) - 1)
            if gap - tol > self.worst - self.worst_tolerance:
                self.worst, self.worst_tolerance = gap, tol
            if lo <= stat <= hi:
                continue
            line = (
                f"noise check at step {step}: the privacy ledger records noise multiplier {recorded:.6g} for this "
                f"round, but the noise the privatizer added measures {z:.6g} ({what}: {n_} coordinates, relative "
                f"gap {gap:.3g}, outside the chi-square range of false alarm {FALSE_ALARM:g}); the reported "
                "epsilon would not be this run's"
            )
            self.mismatch = self.mismatch or line
            if self.stop:
                raise PrivacyMismatch(line + ". Stopped before the next release")
            return

    def describe(self) -> dict:
        return {
            "measured_multiplier": self.pooled,
            "steps_checked": self.steps,
            "coordinates": self.total_n,
            "worst_relative_gap": self.worst,
            "tolerance_at_worst": self.worst_tolerance,
            "column_norm": self.col_norm,
            "mismatch": self.mismatch,
            "brute_force_geometry": self.brute_force,
            "note": "measured from the noise tensors added to the releases (engine/noise_check.py)",
        }

    def state_dict(self) -> dict:
        return {
            "total_ss": self.total_ss,
            "total_n": self.total_n,
            "steps": self.steps,
            "worst": self.worst,
            "worst_tolerance": self.worst_tolerance,
            "mismatch": self.mismatch,
        }

    def load_state_dict(self, state: dict) -> None:
        self.total_ss, self.total_n = float(state["total_ss"]), int(state["total_n"])
        self.steps, self.worst = int(state["steps"]), float(state["worst"])
        self.worst_tolerance = float(state["worst_tolerance"])
        self.mismatch = state.get("mismatch")
