"""The privacy plan of a run, built once from the validated config before anything trains or is written.

It fixes everything the privacy guarantee depends on — the sampler, sigma (given, or calibrated to a target
epsilon), the noise multiplier the accountant sees for the variant, the noise strategy and its sensitivity, the
number of steps (fixed, derived from a target epsilon, or capped by a budget), the ledger's accountant and the notes a
reader of the run folder needs — and refuses, with a :class:`~dp_adam_bench.errors.ConfigError`, every combination
that the accountant could not honestly account for. The model trainer and the vectorised toy tasks both run from it
(:mod:`dp_adam_bench.engine.trainer`).

Accounting follows the sampler:

* ``poisson``: one Poisson-subsampled Gaussian event per step, q = B / N (Abadi et al. 2016; Mironov, Talwar &
  Zhang 2019), so an epsilon budget can stop the run before the step that would exceed it.
* ``single_pass``: cyclic fixed-size batches, each example in one batch per epoch exactly ``steps_per_epoch`` steps
  apart; the whole stream is one Gaussian mechanism with the strategy's sensitivity under ``epochs``
  participations, *without* amplification (Ganesh, McMahan & Thakurta, §2; Choquette-Choo et al. 2023, "Multi-epoch
  matrix factorization mechanisms", arXiv 2211.06530).
* ``shuffle``: reshuffled fixed-size batches, accounted as if Poisson (NOT what the accountant assumes; said so).
* ``cyclic_poisson``: b groups, step t Poisson-samples group t mod b at q = b B / N. With a banded strategy of at
  most b bands (BandMF, or DP-SGD) the run is accounted as ceil(n / b) Poisson-subsampled Gaussian steps at rate q
  (amplified BandMF, Choquette-Choo et al. 2023, arXiv:2306.08153, Thm. 4), one recorded at the first step of each
  cycle; any other strategy gets the conservative Gaussian bound below.
* ``balls_in_bins``: each example in one random bin of b = N // B, bin t mod b at step t (arXiv:2410.06266); the
  conservative bound: the whole stream is one Gaussian mechanism with the sensitivity of ``epochs``
  participations b steps apart, no amplification credit
  (:mod:`dp_adam_bench.privacy.accounting.amplified_mf`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dp_adam_bench.engine.sampling import (
    BallsInBinsSampler,
    CyclicPoissonSampler,
    PoissonSampler,
    ShuffleSampler,
    SinglePassSampler,
)
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.optim.base import Variant
from dp_adam_bench.privacy.noise_factory import NOISE, build_strategy
from dp_adam_bench.privacy.strategies import Strategy

#: Default cap on the memory of a noise mechanism's streaming buffers (``noise.max_memory_gb``).
DEFAULT_NOISE_MEMORY_GB = 4.0
#: the name under which a non-amplified run's budget or target is enforced: its exact Gaussian epsilon
EXACT_GAUSSIAN = "exact_gaussian"
#: samplers whose batches have a random, unbounded size
VARIABLE_BATCHES = {
    "poisson": "Poisson",
    "cyclic_poisson": "cyclic Poisson",
    "balls_in_bins": "balls-in-bins",
}


@dataclass
class PrivacyPlan:
    """Everything about a run's privacy, fixed before it trains. ``steps`` is what the run will train."""

    sampler: object
    sigma: float
    account_sigma: float  # sigma times the variant's sigma factor: the noise multiplier the accountant sees
    noisy: bool  # noise is added (a private mechanism with sigma > 0)
    private: bool  # noisy, and the variant uses no clean statistics
    strategy: Strategy | None
    sensitivity: float | None  # of the whole stream (non-amplified accounting only)
    accountant: str
    delta: float | None
    budget: float | None
    steps: int
    notes: list[str] = field(default_factory=list)
    calibrated: bool = False
    # "poisson": one subsampled Gaussian per step; "amplified_mf": one per cycle of cyclic Poisson (amplified
    # BandMF); "gaussian": the whole stream, one Gaussian mechanism recorded up front. "" = from the sampler.
    accounting: str = ""
    column_norm: float = 1.0  # the strategy's max column norm (amplified_mf: per-participation sensitivity)
    target: float | None = None  # privacy.target_epsilon (sigma calibrated to it, or steps until it)
    warnings: list[str] = field(
        default_factory=list
    )  # notes the command line also prints (also in ``notes``)
    # what the epsilon does not cover (a sampler the accountant does not model, delta >= 1/N): in ``guarantee``,
    # on the terminal with the epsilon, and in ``warnings``
    caveats: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accounting:
            self.accounting = "poisson" if self.sampler.amplification else "gaussian"

    @property
    def amplified(self) -> bool:
        return self.noisy and self.accounting in ("poisson", "amplified_mf")

    def new_ledger(self):
        """The ledger at step 0: a non-amplified run records its one Gaussian mechanism up front (the whole stream
        is released whatever step it stops at)."""
        from dp_adam_bench.privacy.accounting import PrivacyLedger

        ledger = PrivacyLedger()
        if self.noisy and self.accounting == "gaussian":
            ledger.record_gaussian(self.sensitivity / self.account_sigma)
        return ledger

    def rounds_after(self, step: int) -> int:
        """Poisson-subsampled Gaussian rounds the ledger holds after ``step`` steps: one per step (poisson), one
        per started cycle, ceil(step / b) (amplified BandMF), none otherwise (the Gaussian release is up front)."""
        if not self.noisy or self.accounting == "gaussian":
            return 0
        if self.accounting == "amplified_mf":
            return -(-int(step) // self.sampler.cycle_length)
        return int(step)

    def record_step(self, ledger, step: int) -> None:
        """Account training step ``step`` (1-based): the rounds :meth:`rounds_after` adds by then. Counted from the
        step and the ledger alone, so a run resumed from a checkpoint (its ledger, its step) continues exactly."""
        missing = self.rounds_after(step) - ledger.num_poisson_steps
        if missing > 0:
            ledger.record_poisson_step(self.account_sigma / self.column_norm, self.sampler.q, missing)

    def ledger_after(self, steps: int | None = None):
        """The ledger a run ends with after ``steps`` steps (default: the plan's), without running it: what
        :meth:`new_ledger` and :meth:`record_step` make, step by step, in a training run."""
        ledger = self.new_ledger()
        self.record_step(ledger, self.steps if steps is None else int(steps))
        return ledger

    @property
    def bound_accountant(self) -> str:
        """The accountant that holds the run to its budget or target: the whole stream of a non-amplified run is
        one Gaussian mechanism, whose epsilon is computed exactly (``exact_gaussian``, Balle & Wang 2018), tighter
        than any accountant's bound on it; otherwise ``privacy.accountant``."""
        return EXACT_GAUSSIAN if self.accounting == "gaussian" else self.accountant

    def guarantee(self, ledger) -> dict:
        """The accountant of each privacy number of the run, for the summary and :class:`PrivateTraining`:
        ``accountant`` and ``epsilon`` (the epsilon the run reports, under ``privacy.accountant``; progress lines
        show it), and where set, the budget or target with the accountant that enforced it. A non-amplified run
        adds ``exact_gaussian_epsilon``, the epsilon its budget or target was held to. {} without noise."""
        from dp_adam_bench.privacy.accounting import AccountantFailure, mf_epsilon

        if not self.noisy:
            return {}
        try:
            eps = ledger.epsilon(self.delta, self.accountant)
        except AccountantFailure:
            eps = None
        out = {"accountant": self.accountant, "epsilon": eps, "delta": self.delta}
        if self.accounting == "gaussian":
            out[f"{EXACT_GAUSSIAN}_epsilon"] = mf_epsilon(self.account_sigma, self.sensitivity, self.delta)
        if self.budget is not None:
            out |= {"epsilon_budget": self.budget, "budget_accountant": self.bound_accountant}
        if self.target is not None:
            out |= {"target_epsilon": self.target, "target_accountant": self.bound_accountant}
        if self.caveats:
            out["caveats"] = list(self.caveats)
        return out

    def describe(self) -> dict:
        """What the summary records of the plan."""
        return {
            "sigma": self.sigma,
            "account_sigma": self.account_sigma,
            "calibrated_sigma": self.calibrated,
            "accountant": self.accountant,
            "delta": self.delta,
            "epsilon_budget": self.budget,
            "planned_steps": self.sampler.steps,
            "steps": self.steps,
            "sensitivity": self.sensitivity,
            "accounting": self.accounting,
            "cycle_length": getattr(self.sampler, "cycle_length", None),
        }


def _check_accountant_is_guarantee(accountant: str, what: str) -> None:
    from dp_adam_bench.privacy.accounting import ACCOUNTANTS, guarantee_names

    if not ACCOUNTANTS.get(accountant).guarantee:
        raise ConfigError(
            f"privacy.accountant={accountant!r} is an approximation (central limit theorem), not an upper bound on "
            f"epsilon, so it cannot {what}; use one of {', '.join(guarantee_names())} (gdp_clt is still reported "
            "beside them)"
        )


def check_batch_fits(cfg, n: int) -> None:
    """ConfigError when the (expected) batch is larger than the ``n`` private examples."""
    t = cfg.train
    if float(t.batch_size) > n:
        kind = " (expected batch size)" if t.sampler in ("poisson", "cyclic_poisson") else ""
        raise ConfigError(
            f"train.batch_size={t.batch_size}{kind} is larger than the training set ({n} examples)"
        )


def build_sampler(cfg, n: int, steps: int | None, seed: int):
    """The sampler the config names, over ``n`` private examples (checked by :func:`check_batch_fits`)."""
    t = cfg.train
    if t.sampler == "poisson":
        return PoissonSampler(n, float(t.batch_size), steps=steps, seed=seed)
    if t.sampler == "cyclic_poisson":
        b = cycle_length(cfg)
        q = b * float(t.batch_size) / n
        if not q <= 1:
            raise ConfigError(
                f"train.sampler=cyclic_poisson with cycle length {b} and train.batch_size={t.batch_size}: each of "
                f"the {b} groups holds about {n / b:.4g} of the {n} examples, fewer than the expected batch, so "
                f"the sampling rate b B / N = {q:.4g} exceeds 1; lower train.batch_size or the cycle length "
                "(train.cycle_length, or noise.bands for BandMF)"
            )
        return CyclicPoissonSampler(n, float(t.batch_size), steps=steps, cycle_length=b, seed=seed)
    if t.sampler == "balls_in_bins":
        return BallsInBinsSampler(n, n // int(t.batch_size), epochs=int(t.epochs), seed=seed)
    cls = ShuffleSampler if t.sampler == "shuffle" else SinglePassSampler
    return cls(n, int(t.batch_size), epochs=int(t.epochs), seed=seed)


def cycle_length(cfg) -> int:
    """The cycle length b of ``train.sampler=cyclic_poisson``: ``train.cycle_length``, or else the BandMF bands
    (``noise.bands``; the smallest b amplified BandMF allows), 1 for DP-SGD / no noise."""
    b = cfg.train.get("cycle_length")
    if b is not None:
        return int(b)
    kind = cfg.noise.kind
    if kind == "bandmf":
        return int(cfg.noise.bands)
    if kind in ("independent", "none"):
        return 1
    raise ConfigError(
        f"train.cycle_length=null with train.sampler=cyclic_poisson and noise={kind}: there are no bands to "
        "derive it from; set train.cycle_length (an integer >= 1, the min separation of an example's "
        "participations)"
    )


def build_plan(cfg, n: int, variant: Variant, *, numel: int, sampler_seed: int) -> PrivacyPlan:
    """The run's privacy plan over ``n`` private examples and a model of ``numel`` coordinates (per trial for
    vectorised tasks: all trials). ``cfg`` has passed :func:`dp_adam_bench.config.validate`."""
    from dp_adam_bench.privacy.accounting import calibrate_sigma, epsilon, mf_epsilon, steps_to_epsilon
    from dp_adam_bench.privacy.accounting.checks import delta_caveat

    kind = NOISE.get(cfg.noise.kind)
    p = cfg.privacy
    noisy = kind.private
    accountant = p.get("accountant") or "rdp"
    delta = float(p.delta) if noisy else None
    budget = p.get("epsilon_budget") if noisy else None
    budget = float(budget) if budget is not None else None
    target = p.get("target_epsilon") if noisy else None
    sampler_kind = cfg.train.sampler
    notes: list[str] = []
    check_batch_fits(cfg, n)
    if noisy and variant.needs_fixed_batch and sampler_kind in VARIABLE_BATCHES:
        raise ConfigError(
            f"optimizer.name={variant.name!r} bounds the sensitivity of g^2 assuming at most B examples per batch; "
            f"{VARIABLE_BATCHES[sampler_kind]} batches are unbounded: use train.sampler=single_pass"
        )
    if p.get("secure_rng") and int(cfg.train.get("checkpoint_every") or 0):
        raise ConfigError(
            "privacy.secure_rng=true with train.checkpoint_every > 0: a checkpoint holds the noise generators' "
            "state, from which anyone holding the run folder could regenerate the noise; use checkpoint_every=0"
        )

    if noisy and (budget is not None or target is not None):
        _check_accountant_is_guarantee(
            accountant,
            "enforce privacy.epsilon_budget" if budget is not None else "reach privacy.target_epsilon",
        )

    # --- sigma and the number of steps --------------------------------------------------------------------------------
    steps = cfg.train.get("steps")
    calibrated = False
    sigma = 0.0
    if noisy and sampler_kind == "poisson":
        q = float(cfg.train.batch_size) / n
        # sigma = null: calibrated over a fixed Poisson schedule (Li et al. calibrate to eps = 3, 8 this way)
        if p.sigma is None:
            account_sigma = calibrate_sigma(float(target), delta, q, int(steps), accountant)
            sigma = account_sigma / variant.sigma_factor
            calibrated = True
            notes.append(
                f"sigma = {sigma:.6g} calibrated so that {int(steps)} Poisson steps at q = {q:.6g} reach "
                f"epsilon = {target:g} under {accountant} (delta = {delta:g})"
            )
        else:
            sigma = float(p.sigma)
        # train.steps = null: train until the target epsilon (Tang: "until eps ~ 7")
        if steps is None:
            steps = steps_to_epsilon(float(target), sigma * variant.sigma_factor, q, delta, accountant)
            if steps < 1:
                one = epsilon(sigma * variant.sigma_factor, q, 1, delta, accountant)
                raise ConfigError(
                    f"privacy.target_epsilon={target:g} is below the epsilon of a single step ({one:.4g} under "
                    f"{accountant} at sigma = {sigma:g}, q = {q:.4g}): raise the target or privacy.sigma"
                )
            notes.append(f"{steps} steps: the most that stay within epsilon = {target:g} under {accountant}")
    elif noisy and p.sigma is not None:
        sigma = float(p.sigma)
    sampler = build_sampler(cfg, n, int(steps) if steps is not None else None, sampler_seed)

    # --- strategy, accounting, calibration of the other samplers -----------------------------------------------------
    strategy = build_strategy(cfg.noise, sampler.steps) if noisy else None
    warnings: list[str] = []
    caveats: list[str] = []
    if noisy and cfg.noise.kind == "bandmf" and int(cfg.noise.bands) > sampler.steps:
        # kept, not refused: a smoke run of a paper table trains 2 steps of a 128-band strategy
        warnings.append(
            f"noise.bands={int(cfg.noise.bands)} is more than the run's {sampler.steps} steps: BandMF uses "
            f"{sampler.steps} bands (every past step), the same mechanism as noise.bands={sampler.steps}"
        )
        notes.extend(warnings)
    accounting = "poisson" if sampler.amplification else "gaussian"
    column_norm = 1.0
    if noisy and sampler_kind == "cyclic_poisson":
        accounting, column_norm = _cyclic_poisson_accounting(cfg, strategy, sampler, notes)
    if noisy and p.sigma is None and sampler_kind != "poisson":
        sigma = (
            _calibrate(float(target), delta, accountant, accounting, strategy, sampler, cfg, column_norm)
            / variant.sigma_factor
        )
        calibrated = True
        notes.append(
            f"sigma = {sigma:.6g} calibrated so that the run ({sampler.steps} steps, {_how(accounting)}) reaches "
            f"epsilon = {target:g}"
            + (
                f" under {accountant}"
                if accounting != "gaussian"
                else f" under {_EXACT_NOTE.format(accountant)}"
            )
            + f" (delta = {delta:g})"
        )
    account_sigma = sigma * variant.sigma_factor

    # --- sensitivity, memory, budget ----------------------------------------------------------------------------------
    sensitivity = None
    max_steps = sampler.steps
    if noisy:
        streams = variant.releases().streams
        floats = strategy.mechanism().buffer_floats(numel) * streams
        limit = float(cfg.noise.get("max_memory_gb") or DEFAULT_NOISE_MEMORY_GB)
        need = floats * 4 / 2**30
        if need > limit:
            raise ConfigError(
                f"noise={cfg.noise.kind} keeps every past noise draw: {sampler.steps} steps x {numel:,} "
                f"coordinates x {streams} stream(s) = {need:.1f} GiB (float32), over noise.max_memory_gb={limit:g}. "
                "Use noise=bandmf (O(bands x d) memory) or noise=blt (O(buffers x d)), or raise "
                "noise.max_memory_gb if the machine has the memory"
            )
        if sampler_kind == "shuffle":  # a caveat: in the notes, the warnings and the guarantee (below)
            caveats.append(
                "train.sampler=shuffle: this epsilon is Poisson sampling's at q = B/N, and the run's fixed-size "
                "shuffled batches are not Poisson sampling: it is not a guarantee for this run"
            )
        large_delta = delta_caveat(delta, n)
        if large_delta:
            caveats.append(large_delta)
        notes.extend(caveats)
        warnings.extend(caveats)
        if accounting == "gaussian":
            if sampler_kind == "single_pass":
                participations = int(cfg.train.epochs)
                sensitivity = strategy.sensitivity(
                    participations=participations,
                    min_separation=sampler.min_separation if participations > 1 else None,
                )
                notes.append(
                    f"single-pass fixed-size batches ({participations} participation(s), min separation "
                    f"{sampler.min_separation}): a Gaussian mechanism with sensitivity {sensitivity:.4g}, no "
                    "amplification by sampling"
                )
            else:
                sensitivity = _separated_sensitivity(strategy, sampler)
                notes.append(
                    f"{sampler_kind} batches (at most {_rounds(sampler)} participation(s), min separation "
                    f"{sampler.cycle_length}): accounted by the conservative bound, a Gaussian mechanism with "
                    f"sensitivity {sensitivity:.4g} and no amplification credit; {_not_implemented()}"
                )
            if budget is not None:
                cost = mf_epsilon(account_sigma, sensitivity, delta)
                if cost > budget:
                    raise ConfigError(
                        f"privacy.epsilon_budget={budget:g}: the whole run costs epsilon = {cost:.3f} (a "
                        "non-amplified release is paid in full up front); raise the budget or privacy.sigma"
                    )
                notes.append(
                    f"privacy.epsilon_budget = {budget:g} holds: the whole run costs epsilon = {cost:.4g} under "
                    + _EXACT_NOTE.format(accountant)
                )
        elif budget is not None:
            if accounting == "amplified_mf":
                from dp_adam_bench.privacy.accounting.amplified_mf import amplified_steps_to_epsilon

                allowed = amplified_steps_to_epsilon(
                    budget, account_sigma, sampler.q, sampler.cycle_length, delta, accountant, column_norm
                )
            else:
                allowed = steps_to_epsilon(budget, account_sigma, sampler.q, delta, accountant)
            max_steps = min(sampler.steps, allowed)
            if max_steps < 1:
                raise ConfigError(
                    f"privacy.epsilon_budget={budget:g} is below the epsilon of a single step under {accountant}: "
                    "nothing could be trained; raise the budget or privacy.sigma"
                )
            if max_steps < sampler.steps:
                notes.append(
                    f"stops after step {max_steps} of {sampler.steps}: one more would exceed "
                    f"privacy.epsilon_budget = {budget:g} under {accountant}"
                )
    if variant.sigma_factor != 1.0 and noisy:
        notes.append(
            f"{variant.name} releases {variant.releases().streams} noisy quantities per step with sigma = "
            f"{sigma:g} each: accounted with noise multiplier {account_sigma:.4g}"
        )
    if variant.needs_clean and not variant.private:
        notes.append(f"{variant.name} uses clean (un-noised) statistics: a non-private baseline")
    if not (
        math.isfinite(sigma) and sigma >= 0
    ):  # validate() refuses this; a calibration must never yield it
        raise ConfigError(f"privacy.sigma={sigma!r} must be a finite number >= 0")
    return PrivacyPlan(
        sampler=sampler,
        sigma=sigma,
        account_sigma=account_sigma,
        noisy=noisy,
        private=noisy and variant.private,
        strategy=strategy,
        sensitivity=sensitivity,
        accountant=accountant,
        delta=delta,
        budget=budget,
        steps=max_steps,
        notes=notes,
        calibrated=calibrated,
        accounting=accounting,
        column_norm=column_norm,
        target=float(target) if target is not None else None,
        warnings=warnings,
        caveats=caveats,
    )


# --- cyclic Poisson and balls-in-bins (dp_adam_bench.privacy.accounting.amplified_mf) ---------------------------------
def _rounds(sampler) -> int:
    return -(-sampler.steps // sampler.cycle_length)


def _not_implemented() -> str:
    from dp_adam_bench.privacy.accounting.amplified_mf import NOT_IMPLEMENTED

    return NOT_IMPLEMENTED


#: how a non-amplified run's budget or target is met (formatted with privacy.accountant)
_EXACT_NOTE = (
    f"{EXACT_GAUSSIAN} (the whole run is one Gaussian mechanism, its epsilon computed exactly; the summary's "
    "epsilon under {0} is a looser upper bound on the same release)"
)


def _how(accounting: str) -> str:
    return {
        "amplified_mf": "amplified BandMF",
        "gaussian": "one Gaussian mechanism, no amplification",
    }.get(accounting, accounting)


def _separated_sensitivity(strategy, sampler) -> float:
    from dp_adam_bench.privacy.accounting.amplified_mf import separated_sensitivity

    return separated_sensitivity(strategy, sampler.steps, sampler.cycle_length)


def _cyclic_poisson_accounting(cfg, strategy, sampler, notes: list[str]) -> tuple[str, float]:
    """("amplified_mf", max column norm) when C is banded with bands <= b (arXiv:2306.08153, Thm. 4); a
    ConfigError when BandMF is wider than the cycle; ("gaussian", 1) with a note for any other strategy."""
    from dp_adam_bench.privacy.accounting.amplified_mf import AMPLIFIED_BANDMF, amplifies, strategy_bands

    b = sampler.cycle_length
    bands = strategy_bands(strategy)
    if amplifies(strategy, b):
        column_norm = float(strategy.max_column_norm())
        notes.append(
            f"cyclic Poisson sampling (cycle length b = {b}, q = b B / N = {sampler.q:.6g}) with a {bands}-banded "
            f"strategy: amplified BandMF ({AMPLIFIED_BANDMF}), accounted as ceil(steps / b) = {_rounds(sampler)} "
            "Poisson-subsampled Gaussian steps, one recorded at the first step of each cycle"
        )
        return "amplified_mf", column_norm
    if cfg.noise.kind == "bandmf":
        raise ConfigError(
            f"train.sampler=cyclic_poisson with cycle length {b} and noise.bands={strategy.bands}: amplified "
            f"BandMF ({AMPLIFIED_BANDMF}) needs bands <= the cycle length; set train.cycle_length >= "
            f"{strategy.bands} (or null: the bands), or noise.bands <= {b}"
        )
    return "gaussian", 1.0


def _calibrate(target, delta, accountant, accounting, strategy, sampler, cfg, column_norm) -> float:
    """The noise multiplier the accountant sees that makes the run reach ``target`` (non-Poisson samplers)."""
    from dp_adam_bench.privacy.accounting.amplified_mf import (
        calibrate_amplified_sigma,
        calibrate_gaussian_sigma,
    )

    if accounting == "amplified_mf":
        return calibrate_amplified_sigma(
            target, delta, sampler.q, sampler.steps, sampler.cycle_length, accountant, column_norm
        )
    if accounting == "poisson":  # shuffle: validate() refuses sigma = null
        raise ConfigError("privacy.sigma=null (calibrate sigma) is not available with train.sampler=shuffle")
    if cfg.train.sampler == "single_pass":
        k = int(cfg.train.epochs)
        sens = strategy.sensitivity(
            participations=k, min_separation=sampler.min_separation if k > 1 else None
        )
    else:
        sens = _separated_sensitivity(strategy, sampler)
    return calibrate_gaussian_sigma(target, delta, sens)
