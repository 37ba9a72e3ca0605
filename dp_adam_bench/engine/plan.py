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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dp_adam_bench.engine.sampling import PoissonSampler, ShuffleSampler, SinglePassSampler
from dp_adam_bench.errors import ConfigError
from dp_adam_bench.optim.base import Variant
from dp_adam_bench.privacy.noise_factory import NOISE, build_strategy
from dp_adam_bench.privacy.strategies import Strategy

#: Default cap on the memory of a noise mechanism's streaming buffers (``noise.max_memory_gb``).
DEFAULT_NOISE_MEMORY_GB = 4.0


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

    @property
    def amplified(self) -> bool:
        return self.noisy and self.sampler.amplification

    def new_ledger(self):
        """The ledger at step 0: a non-amplified run records its one Gaussian mechanism up front (the whole stream
        is released whatever step it stops at)."""
        from dp_adam_bench.privacy.accounting import PrivacyLedger

        ledger = PrivacyLedger()
        if self.noisy and not self.sampler.amplification:
            ledger.record_gaussian(self.sensitivity / self.account_sigma)
        return ledger

    def record_step(self, ledger) -> None:
        """Account one training step (Poisson-subsampled Gaussian; nothing more for non-amplified runs)."""
        if self.amplified:
            ledger.record_poisson_step(self.account_sigma, self.sampler.q)

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
        kind = " (expected batch size)" if t.sampler == "poisson" else ""
        raise ConfigError(
            f"train.batch_size={t.batch_size}{kind} is larger than the training set ({n} examples)"
        )


def build_sampler(cfg, n: int, steps: int | None, seed: int):
    """The sampler the config names, over ``n`` private examples (checked by :func:`check_batch_fits`)."""
    t = cfg.train
    if t.sampler == "poisson":
        return PoissonSampler(n, float(t.batch_size), steps=steps, seed=seed)
    cls = ShuffleSampler if t.sampler == "shuffle" else SinglePassSampler
    return cls(n, int(t.batch_size), epochs=int(t.epochs), seed=seed)


def build_plan(cfg, n: int, variant: Variant, *, numel: int, sampler_seed: int) -> PrivacyPlan:
    """The run's privacy plan over ``n`` private examples and a model of ``numel`` coordinates (per trial for
    vectorised tasks: all trials). ``cfg`` has passed :func:`dp_adam_bench.config.validate`."""
    from dp_adam_bench.privacy.accounting import calibrate_sigma, epsilon, mf_epsilon, steps_to_epsilon

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
    if noisy and variant.needs_fixed_batch and sampler_kind == "poisson":
        raise ConfigError(
            f"optimizer.name={variant.name!r} bounds the sensitivity of g^2 assuming at most B examples per batch; "
            "Poisson batches are unbounded: use train.sampler=single_pass"
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
    if noisy:
        q = float(cfg.train.batch_size) / n if sampler_kind == "poisson" else None
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
        if sampler_kind == "poisson" and steps is None:
            steps = steps_to_epsilon(float(target), sigma * variant.sigma_factor, q, delta, accountant)
            if steps < 1:
                one = epsilon(sigma * variant.sigma_factor, q, 1, delta, accountant)
                raise ConfigError(
                    f"privacy.target_epsilon={target:g} is below the epsilon of a single step ({one:.4g} under "
                    f"{accountant} at sigma = {sigma:g}, q = {q:.4g}): raise the target or privacy.sigma"
                )
            notes.append(f"{steps} steps: the most that stay within epsilon = {target:g} under {accountant}")
    account_sigma = sigma * variant.sigma_factor
    sampler = build_sampler(cfg, n, int(steps) if steps is not None else None, sampler_seed)

    # --- strategy, sensitivity, memory --------------------------------------------------------------------------------
    strategy = build_strategy(cfg.noise, sampler.steps) if noisy else None
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
        if sampler_kind == "shuffle":
            notes.append(
                "fixed-size shuffled batches: accounted as Poisson sampling with q = B/N, which the "
                "sampler does NOT implement (not DP-faithful)"
            )
        if not sampler.amplification:
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
            if budget is not None:
                cost = mf_epsilon(account_sigma, sensitivity, delta)
                if cost > budget:
                    raise ConfigError(
                        f"privacy.epsilon_budget={budget:g}: the whole run costs epsilon = {cost:.3f} (a "
                        "non-amplified release is paid in full up front); raise the budget or privacy.sigma"
                    )
        elif budget is not None:
            max_steps = min(
                sampler.steps, steps_to_epsilon(budget, account_sigma, sampler.q, delta, accountant)
            )
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
    )
