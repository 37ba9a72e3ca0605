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

from dp_adam_bench.engine.plan_accounting import (
    EXACT_GAUSSIAN,
    PrivacyTerms,
    account_stream,
    caveats,
    check_noise_memory,
    choose_accounting,
)
from dp_adam_bench.engine.plan_sigma import calibrated_stream_sigma, poisson_sigma_and_steps
from dp_adam_bench.engine.samplers import SAMPLERS
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

#: the samplers engine/plan_accounting.py accounts for (each by its own rule): a private run refuses any other
ACCOUNTED_SAMPLERS = ("single_pass", "poisson", "shuffle", "cyclic_poisson", "balls_in_bins")
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
        """What the summary records of the plan, and a checkpoint of the plan it was written under (a resume is
        refused where they differ: :func:`resume_refusal`): with ``population`` (N, the private examples the
        sampler draws from and the accountant counts), ``sampling_rate`` (q; None for the fixed-size samplers),
        ``expected_batch_size`` (B) and ``sampler`` (its kind and settings)."""
        sampler = self.sampler
        return {
            "population": int(sampler.n),
            "sampling_rate": float(sampler.q) if hasattr(sampler, "q") else None,
            "expected_batch_size": float(sampler.expected_batch_size),
            "sampler": sampler_settings(sampler),
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


#: the settings of a sampler, where it has them, that decide which examples each step draws (with its kind)
SAMPLER_SETTINGS = ("batch_size", "epochs", "steps_per_epoch", "cycle_length")


def sampler_settings(sampler) -> dict:
    """``{"kind": ..., and each of SAMPLER_SETTINGS the sampler has}``: what :meth:`PrivacyPlan.describe` records of
    the sampler (its seed is the run's, in the configuration's fingerprint)."""
    out = {"kind": sampler.kind}
    for name in SAMPLER_SETTINGS:
        value = getattr(sampler, name, None)
        if value is not None:
            out[name] = int(value)
    return out


#: the field of :meth:`PrivacyPlan.describe` a resume names first when it changed: the private data set's size
_POPULATION = "population"


def resume_refusal(
    saved: dict | None, here: dict, data: str = "the private data set", saved_by: str = "the saved run's"
) -> str | None:
    """Why a run whose plan is ``here`` (:meth:`PrivacyPlan.describe`) cannot continue a state saved under the plan
    ``saved``, in one line; None when it can. Only the fields ``saved`` holds are compared, so a checkpoint written
    before a field existed (N, q, B and the sampler: older versions) loads as before. A changed N names ``data``
    ("train_dataset has 1,400 examples, the checkpoint's run had 1,500: resume with the same data"), the other
    changed fields follow it; any other change lists each field, saved and here."""
    if saved is None:
        return None
    changed = [k for k in here if k in saved and saved[k] != here[k]]
    if not changed:
        return None
    others = "; ".join(f"{k}: saved {saved[k]!r}, here {here[k]!r}" for k in changed if k != _POPULATION)
    if _POPULATION in changed:
        return (
            f"{data} has {here[_POPULATION]:,} examples, {saved_by} had {saved[_POPULATION]:,}: resume with the "
            "same data" + (f" (also changed: {others})" if others else "")
        )
    return f"this state was saved by a run with another privacy plan ({others}); resume it with the same arguments"


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
    """The sampler the config names (the ``train.sampler`` registry, :mod:`dp_adam_bench.engine.samplers`), over
    ``n`` private examples (checked by :func:`check_batch_fits`)."""
    return SAMPLERS.build(cfg.train.sampler, cfg, n, steps, seed)


def poisson_sampler(cfg, n: int, steps: int | None, seed: int) -> PoissonSampler:
    """Poisson sampling at rate q = B / N (the accountants' assumption)."""
    return PoissonSampler(n, float(cfg.train.batch_size), steps=steps, seed=seed)


def cyclic_poisson_sampler(cfg, n: int, steps: int | None, seed: int) -> CyclicPoissonSampler:
    """Poisson sampling within b cyclic groups (amplified BandMF), at rate b B / N within the step's group."""
    t = cfg.train
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


def balls_in_bins_sampler(cfg, n: int, steps: int | None, seed: int) -> BallsInBinsSampler:
    """Every example in one of N // B bins per epoch, at random."""
    return BallsInBinsSampler(n, n // int(cfg.train.batch_size), epochs=int(cfg.train.epochs), seed=seed)


def shuffle_sampler(cfg, n: int, steps: int | None, seed: int) -> ShuffleSampler:
    """A fresh permutation per epoch, cut into batches of B (not what the accountants assume: flagged)."""
    return ShuffleSampler(n, int(cfg.train.batch_size), epochs=int(cfg.train.epochs), seed=seed)


def single_pass_sampler(cfg, n: int, steps: int | None, seed: int) -> SinglePassSampler:
    """Batches of B cycling through one seeded permutation, the same every epoch (DP-MF's single pass)."""
    return SinglePassSampler(n, int(cfg.train.batch_size), epochs=int(cfg.train.epochs), seed=seed)


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
    vectorised tasks: all trials). ``cfg`` has passed :func:`dp_adam_bench.config.validate`.

    In order: the refusals of what the accountant could not account for; sigma and the steps of a Poisson run
    (:mod:`~dp_adam_bench.engine.plan_sigma`); the sampler and the noise strategy; the accounting, and sigma
    calibrated for any other sampler; then, with noise, the memory, the caveats, and the sensitivity or the
    budget (:mod:`~dp_adam_bench.engine.plan_accounting`)."""
    terms = PrivacyTerms.of(cfg, NOISE.get(cfg.noise.kind).private)
    _refuse_what_cannot_be_accounted(cfg, n, variant, terms)
    notes: list[str] = []
    sigma, steps, calibrated = poisson_sigma_and_steps(cfg, n, variant, terms, notes)
    sampler = build_sampler(cfg, n, int(steps) if steps is not None else None, sampler_seed)
    strategy = build_strategy(cfg.noise, sampler.steps) if terms.noisy else None
    warnings = _bands_beyond_steps(cfg, sampler, terms.noisy)
    notes.extend(warnings)
    accounting, column_norm = choose_accounting(cfg, strategy, sampler, terms.noisy, notes)
    if terms.noisy and terms.sigma is None and cfg.train.sampler != "poisson":
        sigma = calibrated_stream_sigma(
            cfg, terms, variant, accounting, strategy, sampler, column_norm, notes
        )
        calibrated = True
    account_sigma = sigma * variant.sigma_factor
    sensitivity, max_steps, run_caveats = None, sampler.steps, []
    if terms.noisy:
        check_noise_memory(cfg, strategy, variant, sampler, numel)
        run_caveats = caveats(cfg, terms.delta, n)
        notes.extend(run_caveats)
        warnings.extend(run_caveats)
        sensitivity, max_steps = account_stream(
            cfg, terms, accounting, strategy, sampler, account_sigma, column_norm, notes
        )
    notes.extend(_variant_notes(variant, terms.noisy, sigma, account_sigma))
    if not (
        math.isfinite(sigma) and sigma >= 0
    ):  # validate() refuses this; a calibration must never yield it
        raise ConfigError(f"privacy.sigma={sigma!r} must be a finite number >= 0")
    return PrivacyPlan(
        sampler=sampler,
        sigma=sigma,
        account_sigma=account_sigma,
        noisy=terms.noisy,
        private=terms.noisy and variant.private,
        strategy=strategy,
        sensitivity=sensitivity,
        accountant=terms.accountant,
        delta=terms.delta,
        budget=terms.budget,
        steps=max_steps,
        notes=notes,
        calibrated=calibrated,
        accounting=accounting,
        column_norm=column_norm,
        target=float(terms.target) if terms.target is not None else None,
        warnings=warnings,
        caveats=run_caveats,
    )


def _refuse_what_cannot_be_accounted(cfg, n: int, variant: Variant, terms: PrivacyTerms) -> None:
    """ConfigError for a batch larger than the data, a variant that needs fixed-size batches on a sampler whose
    batches are unbounded, checkpoints of a secure-RNG run, and a budget or target under an accountant that is
    not an upper bound."""
    check_batch_fits(cfg, n)
    sampler_kind = cfg.train.sampler
    if terms.noisy and sampler_kind not in ACCOUNTED_SAMPLERS:
        # a sampler registered later (engine/samplers.py) would otherwise be accounted as Poisson sampling
        raise ConfigError(
            f"train.sampler={sampler_kind!r} is registered, but the accounting here knows only "
            f"{', '.join(ACCOUNTED_SAMPLERS)}; a private run with another sampler needs its own accounting "
            "(engine/plan_accounting.py) before it can report an epsilon"
        )
    if terms.noisy and variant.needs_fixed_batch and sampler_kind in VARIABLE_BATCHES:
        raise ConfigError(
            f"optimizer.name={variant.name!r} bounds the sensitivity of g^2 assuming at most B examples per batch; "
            f"{VARIABLE_BATCHES[sampler_kind]} batches are unbounded: use train.sampler=single_pass"
        )
    if cfg.privacy.get("secure_rng") and int(cfg.train.get("checkpoint_every") or 0):
        raise ConfigError(
            "privacy.secure_rng=true with train.checkpoint_every > 0: a checkpoint holds the noise generators' "
            "state, from which anyone holding the run folder could regenerate the noise; use checkpoint_every=0"
        )
    if terms.noisy and (terms.budget is not None or terms.target is not None):
        _check_accountant_is_guarantee(
            terms.accountant,
            "enforce privacy.epsilon_budget" if terms.budget is not None else "reach privacy.target_epsilon",
        )


def _bands_beyond_steps(cfg, sampler, noisy: bool) -> list[str]:
    """The warning when BandMF has more bands than the run has steps (kept, not refused: a smoke run of a paper
    table trains 2 steps of a 128-band strategy)."""
    if not (noisy and cfg.noise.kind == "bandmf" and int(cfg.noise.bands) > sampler.steps):
        return []
    return [
        f"noise.bands={int(cfg.noise.bands)} is more than the run's {sampler.steps} steps: BandMF uses "
        f"{sampler.steps} bands (every past step), the same mechanism as noise.bands={sampler.steps}"
    ]


def _variant_notes(variant: Variant, noisy: bool, sigma: float, account_sigma: float) -> list[str]:
    """What the variant changes about the guarantee: several noisy releases per step (one larger noise
    multiplier for the accountant), or clean statistics (no guarantee at all)."""
    notes = []
    if variant.sigma_factor != 1.0 and noisy:
        notes.append(
            f"{variant.name} releases {variant.releases().streams} noisy quantities per step with sigma = "
            f"{sigma:g} each: accounted with noise multiplier {account_sigma:.4g}"
        )
    if variant.needs_clean and not variant.private:
        notes.append(f"{variant.name} uses clean (un-noised) statistics: a non-private baseline")
    return notes
