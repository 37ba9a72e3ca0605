"""The noise multiplier and the number of steps of a privacy plan (steps of
:func:`dp_adam_bench.engine.plan.build_plan`): ``privacy.sigma`` as given, or calibrated to
``privacy.target_epsilon`` (``sigma = null``); ``train.steps`` as given, or for Poisson sampling the most steps
within the target (``steps = null``).

* Poisson: sigma calibrated over a fixed Poisson schedule, as Li et al. calibrate to eps = 3, 8; or the steps
  until the target epsilon, as Tang & Lecuyer train "until eps ~ 7" (2024, arXiv:2312.14334). Both before the
  sampler exists, which needs the number of steps.
* Any other sampler: sigma calibrated once its accounting is known, for the whole run (amplified BandMF:
  arXiv:2306.08153, Thm. 4; otherwise one Gaussian mechanism at exactly the target, Balle & Wang 2018).

Each returns the sigma of one noisy release; the accountant sees ``sigma * variant.sigma_factor``.
"""

from __future__ import annotations

from dp_adam_bench.engine.plan_accounting import EXACT_NOTE, PrivacyTerms, how, stream_sensitivity
from dp_adam_bench.errors import ConfigError


def poisson_sigma_and_steps(cfg, n: int, variant, terms: PrivacyTerms, notes: list[str]):
    """(sigma, steps, calibrated) before the sampler is built: a noisy Poisson run's sigma calibrated to the
    target over ``train.steps`` (sigma = null) and its steps until the target (steps = null); any other run's
    ``privacy.sigma`` (0 without noise, and for now when it is calibrated later) and ``train.steps``."""
    steps = cfg.train.get("steps")
    if not terms.noisy:
        return 0.0, steps, False
    if cfg.train.sampler != "poisson":
        return (float(terms.sigma) if terms.sigma is not None else 0.0), steps, False
    q = float(cfg.train.batch_size) / n
    calibrated = terms.sigma is None
    sigma = (
        _calibrated_poisson_sigma(terms, variant, q, int(steps), notes) if calibrated else float(terms.sigma)
    )
    if steps is None:
        steps = _steps_until_target(terms, variant, sigma, q, notes)
    return sigma, steps, calibrated


def _calibrated_poisson_sigma(terms: PrivacyTerms, variant, q: float, steps: int, notes: list[str]) -> float:
    """sigma = null: the sigma with which ``steps`` Poisson steps at rate q reach the target (Li et al.)."""
    from dp_adam_bench.privacy.accounting import calibrate_sigma

    target, delta, accountant = terms.target, terms.delta, terms.accountant
    account_sigma = calibrate_sigma(float(target), delta, q, steps, accountant)
    sigma = account_sigma / variant.sigma_factor
    notes.append(
        f"sigma = {sigma:.6g} calibrated so that {steps} Poisson steps at q = {q:.6g} reach "
        f"epsilon = {target:g} under {accountant} (delta = {delta:g})"
    )
    return sigma


def _steps_until_target(terms: PrivacyTerms, variant, sigma: float, q: float, notes: list[str]) -> int:
    """train.steps = null: the most Poisson steps within the target (Tang: "until eps ~ 7"); a ConfigError when
    a single step exceeds it."""
    from dp_adam_bench.privacy.accounting import epsilon, steps_to_epsilon

    target, accountant = terms.target, terms.accountant
    steps = steps_to_epsilon(float(target), sigma * variant.sigma_factor, q, terms.delta, accountant)
    if steps < 1:
        one = epsilon(sigma * variant.sigma_factor, q, 1, terms.delta, accountant)
        raise ConfigError(
            f"privacy.target_epsilon={target:g} is below the epsilon of a single step ({one:.4g} under "
            f"{accountant} at sigma = {sigma:g}, q = {q:.4g}): raise the target or privacy.sigma"
        )
    notes.append(f"{steps} steps: the most that stay within epsilon = {target:g} under {accountant}")
    return steps


def calibrated_stream_sigma(
    cfg,
    terms: PrivacyTerms,
    variant,
    accounting: str,
    strategy,
    sampler,
    column_norm: float,
    notes: list[str],
) -> float:
    """sigma = null with any sampler but Poisson: the sigma with which the whole run (its sampler's steps, under
    its accounting) reaches the target, with a note saying so."""
    account_sigma = _stream_account_sigma(cfg, terms, accounting, strategy, sampler, column_norm)
    sigma = account_sigma / variant.sigma_factor
    under = (
        f" under {terms.accountant}"
        if accounting != "gaussian"
        else f" under {EXACT_NOTE.format(terms.accountant)}"
    )
    notes.append(
        f"sigma = {sigma:.6g} calibrated so that the run ({sampler.steps} steps, {how(accounting)}) reaches "
        f"epsilon = {terms.target:g}" + under + f" (delta = {terms.delta:g})"
    )
    return sigma


def _stream_account_sigma(cfg, terms: PrivacyTerms, accounting, strategy, sampler, column_norm) -> float:
    """The noise multiplier the accountant sees that makes the run reach the target (non-Poisson samplers)."""
    from dp_adam_bench.privacy.accounting.amplified_mf import (
        calibrate_amplified_sigma,
        calibrate_gaussian_sigma,
    )

    target, delta = float(terms.target), terms.delta
    if accounting == "amplified_mf":
        return calibrate_amplified_sigma(
            target, delta, sampler.q, sampler.steps, sampler.cycle_length, terms.accountant, column_norm
        )
    if accounting == "poisson":  # shuffle: validate() refuses sigma = null
        raise ConfigError("privacy.sigma=null (calibrate sigma) is not available with train.sampler=shuffle")
    return calibrate_gaussian_sigma(target, delta, stream_sensitivity(cfg, strategy, sampler))
