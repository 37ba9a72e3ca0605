"""The participation ledger: what a run's sampler and noise streams actually did, reconciled with everything its
accountant and its sensitivity assumed.

The privacy ledger (:mod:`dp_adam_bench.privacy.accounting.ledger`) records what the *plan* says was released; this
one records what *ran*. Per run it keeps, for each of the N private examples (the sampler's numbering):

* ``count``: the number of batches the example was in,
* ``last``: the step (1-based) of its last participation (0: none yet),
* ``min_gap``: the smallest gap, in steps, between two of its participations (the min-separation that the
  multi-participation sensitivity of BandMF / BLT / DP-MF assumes; Choquette-Choo et al. 2023, arXiv 2211.06530),

as int32 arrays (12 bytes an example: 20.4 MB for N = 1.7M), and for the run the steps it observed, the
(step, example) pairs drawn, repeats of an example inside one batch, indices outside [0, N), and for every noise
stream its number of noisy releases (the stream's own draw counter) and a fingerprint of its generator's starting
state. A step costs a sort of the batch's indices and a few gathers and scatters of B entries
(:data:`COST`). It is part of every checkpoint (:meth:`~dp_adam_bench.engine.session.PrivateTraining.state_dict`),
so a resumed run keeps the record of the steps before the kill.

:func:`reconcile` compares it with the privacy ledger and the plan, each check computed here from the observed
record, not through the plan's own helpers (a bug there would otherwise agree with itself):

* **rounds**: the Poisson-subsampled Gaussian rounds in the privacy ledger against the steps taken: one per step
  (``poisson`` and ``shuffle`` accounting), one per started cycle, ceil(T / b), for amplified BandMF
  (arXiv 2306.08153, Thm. 4), none for a non-amplified run (its one Gaussian mechanism is recorded up front).
* **sensitivity** (non-amplified runs: single pass, balls-in-bins, conservative cyclic Poisson): the strategy's
  sensitivity for the most participations any example had, at least the smallest separation any example had
  (:func:`dp_adam_bench.privacy.sensitivity.strategy_sensitivity`), must not exceed the sensitivity of the ledger's
  Gaussian mechanism (mu times the accounted noise multiplier) nor the plan's.
* **separation** (amplified BandMF): no example participates twice within one cycle of b steps.
* **rate** (Poisson and cyclic Poisson): the total count T of (step, example) pairs is Binomial(M, q) for the M
  Bernoulli draws of the observed steps (N per step; the group's size per step for cyclic Poisson) at the q of the
  ledger's rounds. z = (T - M q) / sqrt(M q (1 - q)); a MISMATCH when |z| > :data:`Z_ALARM` = 4.892, a two-sided
  false alarm of 1e-6 for an honest sampler (normal approximation; M q is in the thousands for any run worth
  auditing). Power: a true rate q (1 + r) shifts the count by r M q, against the alternative's standard
  deviation sqrt(M q' (1 - q')), q' = q (1 + r) (:func:`rate_power`); the test detects a relative error r_99 with
  probability 0.99 (about (4.892 + 2.326) / sqrt(M q / (1 - q)) for small r); both r_99 and the power at
  r = 10 % are reported, and the check's detail states r_99 and whether it is within :data:`RATE_VISIBLE` = 1 %
  (a passing rate check on a small run says little: at M q = 5,000 it sees only a 10 % excess).
* **streams**: exactly the noise streams the variant's releases need, each with one release per step taken, no
  two in the same generator state at the start or at the check (they would draw the same noise).
* **batches**: no example twice in one batch (its clipped gradient would count twice) and no index out of range.

What it cannot see: the size of the noise and whether the released noise is what each stream drew (the mechanism
meter, :mod:`dp_adam_bench.audit.meter`); anything after the sampler (clipping, which examples a clipping engine
mixes); whether a Poisson sampler's draws are independent across examples and steps beyond their total rate (a
sampler that draws the same batch every step at the right rate passes the rate test; its participations fail the
sensitivity check only under non-amplified accounting); with ``train.sampler=shuffle`` the gap between Poisson
sampling, which the accountant assumes, and the fixed-size batches that ran (a caveat, not a check); and, after a
resume from a checkpoint written before this ledger existed, the steps before it (said so in the record).
"""

from __future__ import annotations

import functools
import hashlib
import math
from statistics import NormalDist

import torch

#: two-sided false-alarm probability of the rate test under an honest sampler
FALSE_ALARM = 1e-6
Z_ALARM = NormalDist().inv_cdf(1 - FALSE_ALARM / 2)  # 4.8916
POWER = 0.99
Z_POWER = NormalDist().inv_cdf(POWER)  # 2.3263
#: relative error of q at which the rate test's power is reported
RATE_EFFECT = 0.10
#: relative excess of q that the rate check's detail says it can or cannot see (r_99 within it or not)
RATE_VISIBLE = 0.01
#: relative slack for comparing sensitivities computed by the same formula in two places
TOLERANCE = 1e-9
_NO_GAP = torch.iinfo(torch.int32).max
#: measured cost (tests/test_participation.py::test_cost_for_a_large_dataset bounds it): memory per example and the
#: time of one step's record for N = 1.7M examples (Poisson batches, 2-core CPU)
COST = (
    "12 bytes per example (20.4 MB for N = 1.7M); 0.14 ms per step at B = 1,024, 1.3 ms at B = 16,384 (the "
    "Poisson sampler's own draw over N = 1.7M: 8-10 ms per step)"
)


def generator_fingerprint(gen) -> str | None:
    """A short digest of a generator's state (None without one: data-parallel ranks > 0 hold no noise generator)."""
    if gen is None:
        return None
    return hashlib.sha1(gen.get_state().cpu().numpy().tobytes()).hexdigest()[:16]


class ParticipationLedger:
    """What a run's sampler and noise streams did (see the module docstring). ``n``: the private examples;
    ``generators``: each noise stream's generator at step 0 (its fingerprint is kept)."""

    def __init__(self, n: int, generators=()):
        self.n = int(n)
        # bookkeeping of indices, on the CPU whatever the model's device (the sampler's indices are CPU tensors)
        self.count = torch.zeros(self.n, dtype=torch.int32, device="cpu")
        self.last = torch.zeros(self.n, dtype=torch.int32, device="cpu")
        self.min_gap = torch.full((self.n,), _NO_GAP, dtype=torch.int32, device="cpu")
        self.steps = 0
        self.unobserved = 0  # steps taken before the ledger existed (resumed from an older checkpoint)
        self.drawn = 0
        self.repeats = 0
        self.out_of_range = 0
        self.releases: list[int] = []
        self.stream_starts = [generator_fingerprint(g) for g in generators]
        self.stream_now: list[str | None] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.count, self.last, self.min_gap))

    # --- recording ----------------------------------------------------------------------------------------------
    def observe(self, idx: torch.Tensor) -> None:
        """Record the next step's batch: ``idx`` the sampler's indices into the private examples."""
        idx = idx.detach().to("cpu", torch.long).reshape(-1)
        step = self.steps + 1
        self.drawn += idx.numel()
        if idx.numel():
            bad = (idx < 0) | (idx >= self.n)
            if bool(bad.any()):
                self.out_of_range += int(bad.sum())
                idx = idx[~bad]
            unique = torch.unique(idx)
            self.repeats += idx.numel() - unique.numel()
            prev = self.last[unique]
            seen = prev > 0
            if bool(seen.any()):
                again = unique[seen]
                self.min_gap[again] = torch.minimum(self.min_gap[again], step - prev[seen])
            self.count[unique] += 1  # steps an example was in (repeats within a batch: ``repeats``)
            self.last[unique] = step
        self.steps = step

    def observe_releases(self, mechanisms) -> None:
        """Record each noise stream's releases so far (its draw counter)."""
        self.releases = [int(m.step) for m in mechanisms]

    def observe_generators(self, generators) -> None:
        """Record each noise stream's generator state now (two streams in the same state draw the same noise)."""
        self.stream_now = [generator_fingerprint(g) for g in generators]

    def mark_unobserved(self, steps: int) -> None:
        """A resume from a checkpoint without a participation record: its first ``steps`` steps were not seen."""
        self.unobserved = self.steps = int(steps)

    # --- what it saw --------------------------------------------------------------------------------------------
    @property
    def max_participations(self) -> int:
        return int(self.count.max()) if self.n else 0

    @property
    def min_separation(self) -> int | None:
        """The smallest gap between two participations of one example (None: nobody participated twice)."""
        gap = int(self.min_gap.min()) if self.n else _NO_GAP
        return None if gap == _NO_GAP else gap

    def describe(self) -> dict:
        return {
            "examples": self.n,
            "steps": self.steps,
            "unobserved_steps": self.unobserved,
            "drawn": self.drawn,
            "max_participations": self.max_participations,
            "min_separation": self.min_separation,
            "never_sampled": int((self.count == 0).sum()),
            "repeats_in_a_batch": self.repeats,
            "out_of_range": self.out_of_range,
            "releases_per_stream": list(self.releases),
            "memory_bytes": self.nbytes,
        }

    # --- checkpoints --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "n": self.n,
            "count": self.count.clone(),
            "last": self.last.clone(),
            "min_gap": self.min_gap.clone(),
            "steps": self.steps,
            "unobserved": self.unobserved,
            "drawn": self.drawn,
            "repeats": self.repeats,
            "out_of_range": self.out_of_range,
            "releases": list(self.releases),
            "stream_starts": list(self.stream_starts),
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["n"]) != self.n:
            raise ValueError(
                f"the checkpoint's participation ledger covers {state['n']} examples, this run {self.n}"
            )
        for name in ("count", "last", "min_gap"):
            getattr(self, name).copy_(state[name])
        for name in ("steps", "unobserved", "drawn", "repeats", "out_of_range"):
            setattr(self, name, int(state[name]))
        self.releases = [int(r) for r in state["releases"]]
        self.stream_starts = list(state["stream_starts"])


# --- reconciliation ---------------------------------------------------------------------------------------------
def _check(name: str, ok: bool, detail: str) -> dict:
    return {"check": name, "ok": bool(ok), "detail": detail}


def expected_rounds(plan, steps: int) -> int:
    """Poisson-subsampled Gaussian rounds an honest ledger holds after ``steps`` steps (computed here, not by the
    plan's ``rounds_after``)."""
    if not plan.noisy or plan.accounting == "gaussian":
        return 0
    if plan.accounting == "amplified_mf":
        return math.ceil(steps / plan.sampler.cycle_length)
    return int(steps)


def bernoulli_draws(sampler, first: int, last: int) -> int:
    """Bernoulli trials of a Poisson-type sampler over steps ``first+1 .. last``: N per step, or under cyclic
    Poisson the size of group t mod b at step t (0-based)."""
    if getattr(sampler, "kind", "") == "cyclic_poisson":
        sizes = torch.tensor([len(g) for g in sampler.groups], dtype=torch.int64, device="cpu")
        return int(sizes[torch.arange(first, last) % sampler.cycle_length].sum())
    return sampler.n * (last - first)


def rate_power(r: float, draws: int, q: float) -> float:
    """Power of the rate test against a true rate q (1 + r): normal approximation with the alternative's own
    variance, both tails."""
    mean0, sd0 = draws * q, math.sqrt(draws * q * (1 - q))
    q1 = min(max(q * (1 + r), 0.0), 1.0)
    sd1 = math.sqrt(draws * q1 * (1 - q1)) or 1e-300
    shift = draws * q1 - mean0
    return NormalDist().cdf((shift - Z_ALARM * sd0) / sd1) + NormalDist().cdf((-shift - Z_ALARM * sd0) / sd1)


@functools.lru_cache(maxsize=64)
def rate_r99(draws: int, q: float) -> float:
    """The relative error r of q (upwards) that the rate test detects with probability :data:`POWER`."""
    lo, hi = 0.0, 1 / q - 1  # q (1 + r) <= 1
    if rate_power(hi, draws, q) < POWER:
        return math.inf
    for _ in range(60):  # bisection: the power grows with r
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate_power(mid, draws, q) < POWER else (lo, mid)
    return hi


def rate_test(drawn: int, draws: int, q: float) -> dict:
    """The binomial test of the observed count ``drawn`` of ``draws`` Bernoulli(q) trials (module docstring):
    ``ok``, ``z``, and the stated power: ``r99``, the relative error of q (upwards, the direction that costs
    privacy) detected with probability :data:`POWER`, and the power at :data:`RATE_EFFECT`."""
    mean = draws * q
    var = mean * (1 - q)
    if var <= 0:
        z = 0.0 if drawn == mean else math.inf
        return {"z": z, "alarm_z": Z_ALARM, "ok": z == 0.0, "r99": 0.0, "power_at_10pct": 1.0}
    z = (drawn - mean) / math.sqrt(var)
    return {
        "z": z,
        "alarm_z": Z_ALARM,
        "ok": abs(z) <= Z_ALARM,
        "r99": rate_r99(draws, q),
        "power_at_10pct": rate_power(RATE_EFFECT, draws, q),
        "false_alarm": FALSE_ALARM,
        "observed_rate": drawn / draws if draws else math.nan,
    }


def rate_visibility(r99: float) -> str:
    """What the rate test can see at this run's size, for the check's detail: its r_99 (the relative excess of q
    detected with probability :data:`POWER`) and whether that is within :data:`RATE_VISIBLE`. Said in words because
    a passing test whose r_99 is 30 % vouches for much less than its verdict suggests."""
    visible = f"{100 * RATE_VISIBLE:g} %"
    if r99 <= RATE_VISIBLE:
        return (
            f"it detects a relative excess of q of r99 = {100 * r99:.3g} % with probability {POWER:g}: can see a "
            f"{visible} excess"
        )
    if not math.isfinite(r99):
        return (
            f"cannot see a {visible} excess at this run's size: no excess of q is detected with probability "
            f"{POWER:g}"
        )
    return (
        f"cannot see a {visible} excess at this run's size: it sees r99 = {100 * r99:.3g} % (the relative excess of "
        f"q detected with probability {POWER:g})"
    )


def reconcile(part: ParticipationLedger, plan, ledger, streams: int, steps: int, noise=None) -> dict:
    """The participation record against the plan and the privacy ``ledger`` after ``steps`` steps, when the
    variant's releases need ``streams`` noise streams (0 without noise): ``{"verdict": "consistent" |
    "MISMATCH: ...", "checks": [...], ...}`` with :meth:`ParticipationLedger.describe` beside. Callable at any
    step (each check is about the steps taken so far; the module docstring says what each one checks)."""
    checks = [_steps_check(part, steps), _batches_check(part)]
    rate, caveats = None, []
    if plan.noisy:
        checks.append(_rounds_check(plan, ledger, steps))
        k = part.max_participations
        if plan.accounting == "gaussian" and part.repeats == 0 and k >= 1:
            checks.append(_sensitivity_check(part, plan, ledger, noise))
        if plan.accounting == "amplified_mf" and k > 1:
            checks.append(_separation_check(part, plan))
        rate_check, rate = _rate_check(part, plan, ledger, steps)
        if rate_check is not None:
            checks.append(rate_check)
        if plan.sampler.kind == "shuffle":
            caveats.append(
                "train.sampler=shuffle: fixed-size shuffled batches accounted as Poisson sampling at q = B / N, "
                "which did not run; the ledger checks the rounds and the streams, not the sampling"
            )
    if noise is not None and plan.noisy:  # the noise added against the ledger's rounds, every step
        checks.append(_noise_check(noise))
    checks.append(_streams_check(part, streams, steps))
    if part.unobserved:
        caveats.append(
            f"steps 1-{part.unobserved} ran before this participation ledger existed (older checkpoint): not seen"
        )
    return _report(part, checks, rate, caveats)


def _steps_check(part: ParticipationLedger, steps: int) -> dict:
    return _check(
        "steps", part.steps == steps, f"the ledger saw {part.steps} batches of the {steps} steps taken"
    )


def _batches_check(part: ParticipationLedger) -> dict:
    return _check(
        "batches",
        part.repeats == 0 and part.out_of_range == 0,
        f"{part.repeats} repeat(s) of an example inside one batch, {part.out_of_range} index(es) outside "
        f"[0, {part.n})",
    )


def _rounds_check(plan, ledger, steps: int) -> dict:
    rounds, want = ledger.num_poisson_steps, expected_rounds(plan, steps)
    return _check(
        "rounds",
        rounds == want,
        f"the privacy ledger holds {rounds} Poisson round(s); {steps} step(s) of {plan.accounting} "
        f"accounting make {want}",
    )


def _sensitivity_check(part: ParticipationLedger, plan, ledger, noise) -> dict:
    """The sensitivity the observed participations need against what the ledger's Gaussian mechanism and the plan
    account for (non-amplified runs)."""
    from dp_adam_bench.engine.noise_check import tolerance as noise_tolerance
    from dp_adam_bench.privacy.accounting.events import GaussianEvent
    from dp_adam_bench.privacy.sensitivity import strategy_sensitivity

    k, sep = part.max_participations, part.min_separation
    need = strategy_sensitivity(plan.strategy, k, sep if k > 1 else None)
    mu = math.sqrt(sum(e.count * e.mu**2 for e in ledger.events if isinstance(e, GaussianEvent)))
    # also the multiplier measured from the noise added (engine/noise_check.py), at its upper confidence
    # bound: a slip in account_sigma changes mu and the plan's multiplier together, whose product agrees
    measured = noise is not None and noise.total_n > 0
    upper = noise.pooled * (1 + noise_tolerance(noise.total_n)) if measured else math.inf
    multiplier = min(plan.account_sigma, upper)
    accounted = mu * multiplier
    source = "the measured one's upper bound" if upper < plan.account_sigma else "the plan's"
    claimed = min(accounted, plan.sensitivity if plan.sensitivity is not None else math.inf)
    apart = f" at least {sep} steps apart" if k > 1 else ""
    return _check(
        "sensitivity",
        claimed >= need * (1 - TOLERANCE),
        f"{k} participation(s){apart} need sensitivity {need:.4g}; accounted for {accounted:.4g} "
        f"(ledger mu {mu:.4g} x noise multiplier {multiplier:.4g}, "
        f"{source}), plan "
        f"{plan.sensitivity if plan.sensitivity is not None else float('nan'):.4g}",
    )


def _separation_check(part: ParticipationLedger, plan) -> dict:
    b, sep = plan.sampler.cycle_length, part.min_separation
    return _check(
        "separation",
        sep >= b,
        f"an example participated {sep} step(s) after its previous participation; amplified "
        f"BandMF assumes at least the cycle length b = {b}",
    )


def _rate_check(part: ParticipationLedger, plan, ledger, steps: int) -> tuple[dict | None, dict | None]:
    """(check, :func:`rate_test` result) of a Poisson-type sampler under amplified accounting; (None, None)
    otherwise. A ledger whose rounds use several rates fails it (once a step was taken)."""
    from dp_adam_bench.privacy.accounting.events import PoissonGaussianEvent

    if plan.sampler.kind not in ("poisson", "cyclic_poisson") or plan.accounting == "gaussian":
        return None, None
    qs = sorted({e.q for e in ledger.events if isinstance(e, PoissonGaussianEvent)})
    if len(qs) != 1:
        several = _check("rate", False, f"the ledger's rounds use {len(qs)} sampling rates {qs}")
        return (several if steps else None), None
    draws = bernoulli_draws(plan.sampler, part.unobserved, steps)
    rate = rate_test(part.drawn, draws, qs[0])
    check = _check(
        "rate",
        rate["ok"],
        f"{part.drawn} (step, example) pairs drawn of {draws} Bernoulli trials at the ledger's "
        f"q = {qs[0]:.6g} (expected {draws * qs[0]:.1f}): z = {rate['z']:+.2f}, alarm beyond "
        f"|z| > {Z_ALARM:.3f}; {rate_visibility(rate['r99'])}",
    )
    return check, rate


def _noise_check(noise) -> dict:
    return _check(
        "noise",
        noise.mismatch is None,
        noise.mismatch
        or f"the noise added measures multiplier {noise.pooled:.6g} over {noise.steps} step(s) "
        f"({noise.total_n} coordinates); every step within tolerance of the ledger's round",
    )


def _streams_check(part: ParticipationLedger, streams: int, steps: int) -> dict:
    got = len(part.releases)
    short = [(s, r) for s, r in enumerate(part.releases) if r != steps]
    starts = [f for f in part.stream_starts if f is not None]
    now = [f for f in part.stream_now if f is not None]
    shared = len(set(starts)) != len(starts) or len(set(now)) != len(now)
    return _check(
        "streams",
        got == streams and not short and not shared,
        f"{got} noise stream(s) for the {streams} the variant's releases need; releases per stream "
        f"{part.releases} in {steps} step(s)"
        + ("; two streams share a generator state (the same noise)" if shared else ""),
    )


def _report(part: ParticipationLedger, checks: list[dict], rate: dict | None, caveats: list[str]) -> dict:
    """The verdict (every failed check named, with its detail), the checks, the record, the rate test and the
    caveats."""
    failed = [c for c in checks if not c["ok"]]
    verdict = (
        "consistent"
        if not failed
        else "MISMATCH: " + "; ".join(f"{c['check']}: {c['detail']}" for c in failed)
    )
    out = {"verdict": verdict, "checks": checks, **part.describe()}
    if rate is not None:
        out["rate_test"] = rate
    if caveats:
        out["caveats"] = caveats
    return out
