"""How a privacy plan accounts its stream (the steps of :func:`dp_adam_bench.engine.plan.build_plan` after the
sampler exists): amplified or not, the sensitivity of a non-amplified release, the epsilon budget, the caveats of
what the epsilon does not cover, and the memory the noise mechanism needs.

* Amplified accounting (``poisson``, and ``amplified_mf`` for cyclic Poisson with a banded strategy of at most b
  bands: Choquette-Choo et al. 2023, arXiv:2306.08153, Thm. 4): a budget caps the steps, the step that would
  exceed it is never drawn.
* Non-amplified accounting (``gaussian``: single pass, balls-in-bins, conservative cyclic Poisson): the whole
  stream is one Gaussian mechanism with the strategy's sensitivity under the participations the sampler allows
  (Ganesh, McMahan & Thakurta, §2; Choquette-Choo et al. 2023, "Multi-epoch matrix factorization mechanisms",
  arXiv 2211.06530), paid in full up front, its epsilon computed exactly (:data:`EXACT_GAUSSIAN`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dp_adam_bench.errors import ConfigError

#: Default cap on the memory of a noise mechanism's streaming buffers (``noise.max_memory_gb``).
DEFAULT_NOISE_MEMORY_GB = 4.0
#: the name under which a non-amplified run's budget or target is enforced: its exact Gaussian epsilon
EXACT_GAUSSIAN = "exact_gaussian"
#: how a non-amplified run's budget or target is met (formatted with privacy.accountant)
EXACT_NOTE = (
    f"{EXACT_GAUSSIAN} (the whole run is one Gaussian mechanism, its epsilon computed exactly; the summary's "
    "epsilon under {0} is a looser upper bound on the same release)"
)


@dataclass(frozen=True)
class PrivacyTerms:
    """What ``privacy.*`` asks of a run, read once: ``noisy`` (the noise kind is private); then, for a noisy run
    only (None otherwise), ``delta``, ``budget`` (``epsilon_budget``) and ``target`` (``target_epsilon``, as
    given); ``accountant`` and ``sigma`` (as given, None: calibrate it) whatever the noise."""

    noisy: bool
    accountant: str
    delta: float | None
    budget: float | None
    target: float | None
    sigma: float | None

    @classmethod
    def of(cls, cfg, noisy: bool) -> PrivacyTerms:
        p = cfg.privacy
        budget = p.get("epsilon_budget") if noisy else None
        return cls(
            noisy=noisy,
            accountant=p.get("accountant") or "rdp",
            delta=float(p.delta) if noisy else None,
            budget=float(budget) if budget is not None else None,
            target=p.get("target_epsilon") if noisy else None,
            sigma=p.sigma,
        )


# --- which accounting -------------------------------------------------------------------------------------------
def rounds(sampler) -> int:
    """ceil(steps / b): the cycles of a cyclic sampler, the most participations of one example."""
    return -(-sampler.steps // sampler.cycle_length)


def how(accounting: str) -> str:
    """The accounting in words, for the notes."""
    return {
        "amplified_mf": "amplified BandMF",
        "gaussian": "one Gaussian mechanism, no amplification",
    }.get(accounting, accounting)


def choose_accounting(cfg, strategy, sampler, noisy: bool, notes: list[str]) -> tuple[str, float]:
    """(accounting, max column norm of C): from the sampler (``poisson`` when it amplifies, else ``gaussian``),
    except that a noisy cyclic Poisson run is accounted by :func:`cyclic_poisson_accounting`."""
    if noisy and cfg.train.sampler == "cyclic_poisson":
        return cyclic_poisson_accounting(cfg, strategy, sampler, notes)
    return ("poisson" if sampler.amplification else "gaussian"), 1.0


def cyclic_poisson_accounting(cfg, strategy, sampler, notes: list[str]) -> tuple[str, float]:
    """("amplified_mf", max column norm) when C is banded with bands <= b (arXiv:2306.08153, Thm. 4); a
    ConfigError when BandMF is wider than the cycle; ("gaussian", 1) with a note for any other strategy."""
    from dp_adam_bench.privacy.accounting.amplified_mf import AMPLIFIED_BANDMF, amplifies, strategy_bands

    b = sampler.cycle_length
    bands = strategy_bands(strategy)
    if amplifies(strategy, b):
        column_norm = float(strategy.max_column_norm())
        notes.append(
            f"cyclic Poisson sampling (cycle length b = {b}, q = b B / N = {sampler.q:.6g}) with a {bands}-banded "
            f"strategy: amplified BandMF ({AMPLIFIED_BANDMF}), accounted as ceil(steps / b) = {rounds(sampler)} "
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


# --- the sensitivity of a non-amplified release ------------------------------------------------------------------
def stream_sensitivity(cfg, strategy, sampler) -> float:
    """The sensitivity of the whole stream under non-amplified accounting: single pass, the strategy's for
    ``train.epochs`` participations ``steps_per_epoch`` apart (arXiv 2211.06530); balls-in-bins and conservative
    cyclic Poisson, for ceil(steps / b) participations at least b apart
    (:func:`dp_adam_bench.privacy.accounting.amplified_mf.separated_sensitivity`)."""
    from dp_adam_bench.privacy.accounting.amplified_mf import separated_sensitivity

    if cfg.train.sampler == "single_pass":
        k = int(cfg.train.epochs)
        return strategy.sensitivity(
            participations=k, min_separation=sampler.min_separation if k > 1 else None
        )
    return separated_sensitivity(strategy, sampler.steps, sampler.cycle_length)


def _sensitivity_note(cfg, sampler, sensitivity: float) -> str:
    from dp_adam_bench.privacy.accounting.amplified_mf import NOT_IMPLEMENTED

    if cfg.train.sampler == "single_pass":
        return (
            f"single-pass fixed-size batches ({int(cfg.train.epochs)} participation(s), min separation "
            f"{sampler.min_separation}): a Gaussian mechanism with sensitivity {sensitivity:.4g}, no "
            "amplification by sampling"
        )
    return (
        f"{cfg.train.sampler} batches (at most {rounds(sampler)} participation(s), min separation "
        f"{sampler.cycle_length}): accounted by the conservative bound, a Gaussian mechanism with "
        f"sensitivity {sensitivity:.4g} and no amplification credit; {NOT_IMPLEMENTED}"
    )


# --- what the noise costs: memory, caveats, the budget ------------------------------------------------------------
def check_noise_memory(cfg, strategy, variant, sampler, numel: int) -> None:
    """ConfigError when the noise mechanism's buffers for ``numel`` coordinates and every noise stream of the
    variant exceed ``noise.max_memory_gb`` (float32)."""
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


def caveats(cfg, delta: float, n: int) -> list[str]:
    """What the epsilon does not cover: a sampler the accountant does not model (shuffle), delta >= 1/N."""
    from dp_adam_bench.privacy.accounting.checks import delta_caveat

    out = []
    if cfg.train.sampler == "shuffle":
        out.append(
            "train.sampler=shuffle: this epsilon is Poisson sampling's at q = B/N, and the run's fixed-size "
            "shuffled batches are not Poisson sampling: it is not a guarantee for this run"
        )
    large_delta = delta_caveat(delta, n)
    if large_delta:
        out.append(large_delta)
    return out


def account_stream(
    cfg,
    terms: PrivacyTerms,
    accounting: str,
    strategy,
    sampler,
    account_sigma: float,
    column_norm: float,
    notes,
) -> tuple[float | None, int]:
    """(sensitivity, steps the run trains) of a noisy run: a non-amplified run's stream sensitivity (its budget,
    if any, must hold for the whole release up front); an amplified run's sensitivity is None and a budget caps
    its steps."""
    if accounting == "gaussian":
        sensitivity = stream_sensitivity(cfg, strategy, sampler)
        notes.append(_sensitivity_note(cfg, sampler, sensitivity))
        if terms.budget is not None:
            notes.append(_gaussian_budget_note(terms, account_sigma, sensitivity))
        return sensitivity, sampler.steps
    if terms.budget is None:
        return None, sampler.steps
    return None, _steps_within_budget(terms, accounting, sampler, account_sigma, column_norm, notes)


def _gaussian_budget_note(terms: PrivacyTerms, account_sigma: float, sensitivity: float) -> str:
    """The note that the whole non-amplified release fits ``privacy.epsilon_budget``; a ConfigError when not."""
    from dp_adam_bench.privacy.accounting import mf_epsilon

    cost = mf_epsilon(account_sigma, sensitivity, terms.delta)
    if cost > terms.budget:
        raise ConfigError(
            f"privacy.epsilon_budget={terms.budget:g}: the whole run costs epsilon = {cost:.3f} (a "
            "non-amplified release is paid in full up front); raise the budget or privacy.sigma"
        )
    return (
        f"privacy.epsilon_budget = {terms.budget:g} holds: the whole run costs epsilon = {cost:.4g} under "
        + EXACT_NOTE.format(terms.accountant)
    )


def _steps_within_budget(terms, accounting, sampler, account_sigma, column_norm, notes) -> int:
    """The most steps of an amplified run within ``privacy.epsilon_budget`` (at most the sampler's); a
    ConfigError when not even one step fits."""
    from dp_adam_bench.privacy.accounting import steps_to_epsilon
    from dp_adam_bench.privacy.accounting.amplified_mf import amplified_steps_to_epsilon

    budget, accountant = terms.budget, terms.accountant
    if accounting == "amplified_mf":
        allowed = amplified_steps_to_epsilon(
            budget, account_sigma, sampler.q, sampler.cycle_length, terms.delta, accountant, column_norm
        )
    else:
        allowed = steps_to_epsilon(budget, account_sigma, sampler.q, terms.delta, accountant)
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
    return max_steps
