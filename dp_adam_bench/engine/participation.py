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
state; per step, a digest of its batch, its size and its two most frequent gaps to a previous participation
(:data:`STEP_BYTES` = 28 bytes). A step costs a sort of the batch's indices and of its gaps, a hash of B indices
and a few gathers and scatters of B entries (:data:`COST`). It is part of every checkpoint
(:meth:`~dp_adam_bench.engine.session.PrivateTraining.state_dict`), so a resumed run keeps the record of the steps
before the kill.

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
* **repeated_batch** (Poisson and cyclic Poisson): no two steps drew the same set of at least m examples. Two
  independent Poisson batches over n examples at rate q are the same set S with probability
  sum_S P(S)^2 = (q^2 + (1 - q)^2)^n, and the same set of at least m examples with probability
  P_m = sum_{k >= m} C(n, k) q^{2k} (1 - q)^{2(n - k)} (:func:`log_coincidence`, a rigorous upper bound); over the
  run's pairs of steps (those of one group under cyclic Poisson) the union bound gives a false alarm of at most
  pairs x P_m, plus pairs x 2^-64 for two different batches sharing a digest. m (:func:`min_repeat_size`) is the
  smallest size that keeps this below :data:`REPEAT_FALSE_ALARM` = 1e-6; the check reports m and the bound. Power:
  a sampler that draws any batch of at least m examples twice is caught with probability 1 (a 1,024-example batch
  at N = 1.7M: m = 1; N = 200, q = 0.1, 30 steps: m = 1; N = 20, q = 0.05, 50 steps: m = 5; at N = 5, q = 0.5
  two full batches coincide with probability 1/1,024 per pair, and no m exists: the check says it cannot see).
  Memory: a digest and a size per step (:data:`STEP_BYTES`).
* **near_repeat** (Poisson and cyclic Poisson): no step drew a large share of its examples at one gap g from their
  previous participation (a batch drawn again minus or plus a few examples). Under Poisson sampling, given the
  batch S_t, each member's previous participation is at step t - g independently with probability
  p_g = q (1 - q)^(g - 1) (under cyclic Poisson g = j b, p_g = q (1 - q)^(j - 1)), so the number c of members at
  gap g is Binomial(|S_t|, p_g). The step's two most frequent gaps are kept (their counts are read off ``last``,
  no batch is stored); the check alarms when the binomial upper tail P(>= c) (:func:`log_upper_tail`, an upper
  bound) is below 1e-6 / H, H the run's (step, gap) hypotheses (T^2 / 2 for T steps): a false alarm of at most
  1e-6 over the whole run, whichever gaps were kept. Power: the detail states the smallest share of a batch of
  the expected size B at gap b (1 for Poisson) that is caught (N = 200, q = 0.1, 15 steps: 13 of 20).

What it cannot see: the size of the noise and whether the released noise is what each stream drew (the mechanism
meter, :mod:`dp_adam_bench.audit.meter`); anything after the sampler (clipping, which examples a clipping engine
mixes); whether a Poisson sampler's draws are independent across examples and steps beyond their total rate, the
exact repeats of batches of at least m examples and the near repeats above (a sampler that draws correlated
batches that are neither, such as a fixed part of the data never drawn at the right total rate, or a batch drawn
again after most of its members took part in between, passes; so does a repeated batch smaller than m, or a near
repeat whose share at one gap is not among the step's two largest or is below the stated power); with
``train.sampler=shuffle`` the gap between Poisson sampling, which the accountant assumes, and the fixed-size
batches that ran (a caveat, not a check); and, after a resume from a checkpoint written before this ledger (or its
per-step record) existed, the steps before it (said so in the record).
"""

from __future__ import annotations

import functools
import hashlib
import math
from array import array
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
#: false-alarm probability of each batch-repeat check (repeated_batch, near_repeat) over a whole honest run
REPEAT_FALSE_ALARM = 1e-6
#: bytes of a batch's digest (blake2b of its sorted indices): two different batches share one with probability
#: 2^-64, which the repeated-batch bound counts
DIGEST_BYTES = 8
#: gaps kept per step for the near-repeat check (the most frequent ones)
GAPS_KEPT = 2
#: the per-step record: a digest, a size, and GAPS_KEPT (gap, count) pairs of int32
STEP_BYTES = DIGEST_BYTES + 4 + 8 * GAPS_KEPT
#: measured cost (tests/test_participation.py::test_cost_for_a_large_dataset bounds it): memory per example and the
#: time of one step's record for N = 1.7M examples (Poisson batches, 2-core CPU)
COST = (
    "12 bytes per example (20.4 MB for N = 1.7M) and 28 per step; 0.29 ms per step at B = 1,024, 2.2 ms at "
    "B = 16,384 (the Poisson sampler's own draw over N = 1.7M: 8-10 ms per step)"
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
        self._clear_steps(0)

    def _clear_steps(self, recorded_from: int) -> None:
        """An empty per-step record, whose first entry will be step ``recorded_from + 1``."""
        self.recorded_from = int(recorded_from)
        self.digests = array("q")  # blake2b of the sorted unique indices, as a signed int64
        self.sizes = array("i")  # unique in-range examples
        self.gap_lags = array("i")  # GAPS_KEPT per step: the most frequent gaps to a previous participation
        self.gap_counts = array("i")  # and how many of the batch's examples had each (0: none)

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
            unique = torch.unique(idx)  # sorted
            self.repeats += idx.numel() - unique.numel()
            prev = self.last[unique]
            seen = prev > 0
            gaps = step - prev[seen]
            if gaps.numel():
                again = unique[seen]
                self.min_gap[again] = torch.minimum(self.min_gap[again], gaps)
            self.count[unique] += 1  # steps an example was in (repeats within a batch: ``repeats``)
            self.last[unique] = step
        else:
            unique, gaps = idx, idx
        self._record_step(unique, gaps)
        self.steps = step

    def _record_step(self, unique: torch.Tensor, gaps: torch.Tensor) -> None:
        """The step's digest and size, and its :data:`GAPS_KEPT` most frequent gaps to a previous participation."""
        blob = unique.numpy().tobytes()
        digest = hashlib.blake2b(blob, digest_size=DIGEST_BYTES).digest()
        self.digests.append(int.from_bytes(digest, "little", signed=True))
        self.sizes.append(unique.numel())
        lags, counts = [0] * GAPS_KEPT, [0] * GAPS_KEPT
        if gaps.numel():
            values, freq = torch.unique(gaps, return_counts=True)
            top = torch.topk(freq, min(GAPS_KEPT, freq.numel())).indices
            for j, i in enumerate(top.tolist()):
                lags[j], counts[j] = int(values[i]), int(freq[i])
        self.gap_lags.extend(lags)
        self.gap_counts.extend(counts)

    def observe_releases(self, mechanisms) -> None:
        """Record each noise stream's releases so far (its draw counter)."""
        self.releases = [int(m.step) for m in mechanisms]

    def observe_generators(self, generators) -> None:
        """Record each noise stream's generator state now (two streams in the same state draw the same noise)."""
        self.stream_now = [generator_fingerprint(g) for g in generators]

    def mark_unobserved(self, steps: int) -> None:
        """A resume from a checkpoint without a participation record: its first ``steps`` steps were not seen."""
        self.unobserved = self.steps = int(steps)
        self._clear_steps(self.steps)

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
            "recorded_from": self.recorded_from,
            "digests": torch.tensor(self.digests, device="cpu", dtype=torch.int64),
            "sizes": torch.tensor(self.sizes, device="cpu", dtype=torch.int32),
            "gap_lags": torch.tensor(self.gap_lags, device="cpu", dtype=torch.int32),
            "gap_counts": torch.tensor(self.gap_counts, device="cpu", dtype=torch.int32),
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
        if "digests" not in state:  # written before the per-step record existed: its steps are not in it
            self._clear_steps(self.steps)
            return
        self._clear_steps(int(state["recorded_from"]))
        self.digests.extend(state["digests"].tolist())
        self.sizes.extend(state["sizes"].tolist())
        self.gap_lags.extend(state["gap_lags"].tolist())
        self.gap_counts.extend(state["gap_counts"].tolist())
        if len(self.sizes) != self.steps - self.recorded_from:
            raise ValueError(
                f"the checkpoint's participation ledger records {len(self.sizes)} batches for steps "
                f"{self.recorded_from + 1}-{self.steps}"
            )


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


# --- repeated batches ---------------------------------------------------------------------------------------------
def log_upper_tail(n, k, p) -> torch.Tensor:
    """log of an upper bound on P(Binomial(n, p) >= k), elementwise over float64 tensors (or numbers): the term at
    k over 1 - r, r = (n - k) p / ((k + 1) (1 - p)) the ratio of consecutive terms at k, which falls with k (so the
    terms beyond k are below a geometric series); 0 (the bound 1) where r >= 1 or k <= 0, -inf where k > n."""
    n, k, p = (torch.as_tensor(v, dtype=torch.float64) for v in (n, k, p))
    n, k, p = torch.broadcast_tensors(n, k, p)
    inside = (k >= 1) & (k <= n) & (p > 0) & (p < 1)
    kk, pp = torch.where(inside, k, 1.0), torch.where(inside, p, 0.5)
    term = (
        torch.lgamma(n + 1) - torch.lgamma(kk + 1) - torch.lgamma(n - kk + 1)
        + kk * torch.log(pp) + (n - kk) * torch.log1p(-pp)
    )  # fmt: skip
    r = (n - kk) / (kk + 1) * pp / (1 - pp)
    geometric = term - torch.log1p(-torch.where(r < 1, r, 0.0))  # term / (1 - r)
    bound = torch.where(r < 1, torch.clamp(geometric, max=0.0), 0.0)
    bound = torch.where(inside, bound, 0.0)
    bound = torch.where((k >= 1) & (p <= 0), -math.inf, bound)
    return torch.where(k > n, -math.inf, bound)


def log_coincidence(n: int, q: float, m: int) -> float:
    """log of an upper bound on the probability that two independent Poisson batches over ``n`` examples at rate
    ``q`` are the same set of at least ``m`` examples: sum_{k >= m} C(n, k) q^{2k} (1 - q)^{2(n - k)}
    = s^n P(Binomial(n, q^2 / s) >= m), s = q^2 + (1 - q)^2 (:func:`log_upper_tail` for the tail)."""
    a, b = q * q, (1 - q) * (1 - q)
    s = a + b
    return n * math.log(s) + float(log_upper_tail(n, m, a / s))


def _groups(sampler) -> tuple[int, list[int]]:
    """(b, the size of each group): b = 1 and one group of N for Poisson sampling."""
    if getattr(sampler, "kind", "") == "cyclic_poisson":
        return int(sampler.cycle_length), [len(g) for g in sampler.groups]
    return 1, [int(sampler.n)]


def _pairs_per_group(first: int, last: int, b: int) -> list[int]:
    """Pairs of steps first+1 .. last (1-based) drawn from the same group (step t draws group (t - 1) mod b)."""
    per = [0] * b
    for g in range(b):
        # steps t in (first, last] with (t - 1) mod b == g
        lo = first + ((g - first) % b)  # the smallest t - 1 >= first with (t - 1) mod b == g
        per[g] = max(0, (last - 1 - lo) // b + 1) if lo <= last - 1 else 0
    return [c * (c - 1) // 2 for c in per]


def repeat_false_alarm(sampler, first: int, last: int, m: int) -> float:
    """Upper bound on the probability that an honest Poisson-type sampler draws, at two of steps first+1 .. last,
    the same set of at least ``m`` examples, or two different sets sharing a digest (2^-64 per pair)."""
    b, sizes = _groups(sampler)
    q = float(sampler.q)
    pairs = _pairs_per_group(first, last, b)
    total = (last - first) * (last - first - 1) // 2
    chance = sum(c * math.exp(log_coincidence(n, q, m)) for c, n in zip(pairs, sizes, strict=True) if c)
    return chance + total * 2.0 ** (-8 * DIGEST_BYTES)


def min_repeat_size(sampler, first: int, last: int) -> int | None:
    """The smallest m >= 1 with :func:`repeat_false_alarm` <= :data:`REPEAT_FALSE_ALARM` over steps
    first+1 .. last (None: even repeats of whole groups are too likely, or too many pairs for the digests). The
    bound falls with m, so a bisection finds it."""
    hi = max(_groups(sampler)[1])
    if repeat_false_alarm(sampler, first, last, hi) > REPEAT_FALSE_ALARM:
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (
            (lo, mid)
            if repeat_false_alarm(sampler, first, last, mid) <= REPEAT_FALSE_ALARM
            else (mid + 1, hi)
        )
    return lo


def _hypotheses(unobserved: int, first: int, last: int, b: int) -> int:
    """(step, gap) pairs the near-repeat check may test at steps first+1 .. last: at step t, the gaps j b that
    reach back to an observed step (t - j b > ``unobserved``)."""

    def upto(m: int) -> int:  # sum_{i=0}^{m-1} floor(i / b)
        full, rest = divmod(max(m, 0), b)
        return b * full * (full - 1) // 2 + full * rest

    return upto(last - unobserved) - upto(first - unobserved)


def repeat_checks(part: ParticipationLedger, sampler, steps: int) -> tuple[list[dict], dict]:
    """The repeated-batch and near-repeat checks (module docstring) of the steps the ledger recorded one by one,
    for a Poisson-type ``sampler`` (its q, and its groups under cyclic Poisson), and what they can see."""
    q, first, last = float(sampler.q), part.recorded_from, part.recorded_from + len(part.sizes)
    b, sizes = _groups(sampler)
    info: dict = {
        "false_alarm": REPEAT_FALSE_ALARM,
        "steps_recorded": last - first,
        "bytes_per_step": STEP_BYTES,
    }
    if not 0 < q < 1:
        detail = f"q = {q:.6g}: every member of a group is in every batch of it; repeats are the design"
        return [_check("repeated_batch", True, detail)], info
    return [
        _repeated_batch_check(part, sampler, q, first, last, info),
        _near_repeat_check(part, q, b, sizes, info),
    ], info


def _repeated_batch_check(
    part: ParticipationLedger, sampler, q: float, first: int, last: int, info: dict
) -> dict:
    m = min_repeat_size(sampler, first, last) if last - first >= 2 else None
    info["min_repeat_size"] = m
    where = f"Poisson sampling at q = {q:.6g}" + (
        f" within {sampler.cycle_length} groups" if getattr(sampler, "kind", "") == "cyclic_poisson" else ""
    )
    if last - first < 2:
        return _check("repeated_batch", True, f"{last - first} batch(es) recorded: no pair to compare")
    if m is None:
        whole = max(_groups(sampler)[1])
        return _check(
            "repeated_batch",
            True,
            f"cannot see a repeated batch at this run's size: under {where}, even two batches of all {whole} "
            f"examples coincide with probability {math.exp(2 * whole * math.log(q)):.3g} per pair, above the "
            f"false alarm {REPEAT_FALSE_ALARM:g} over the run's pairs",
        )
    bound = repeat_false_alarm(sampler, first, last, m)
    info["bound"] = bound
    seen: dict[tuple[int, int], int] = {}
    found: list[tuple[int, int, int]] = []
    for i, (digest, size) in enumerate(zip(part.digests, part.sizes, strict=True)):
        if size < m:
            continue
        step = first + 1 + i
        earlier = seen.setdefault((digest, size), step)
        if earlier != step:
            found.append((earlier, step, size))
    pairs = (last - first) * (last - first - 1) // 2
    odds = (
        f"under {where} from {part.n} examples, two batches are the same set of >= {m} examples with probability "
        f"<= {bound:.2g} over the run's {pairs} pairs of steps (false alarm {REPEAT_FALSE_ALARM:g})"
    )
    if not found:
        return _check(
            "repeated_batch",
            True,
            f"no two of {last - first} batches are the same set of >= {m} examples ({odds}); any batch of >= {m} "
            "drawn twice is caught",
        )
    a, c, size = found[0]
    more = f"; {len(found) - 1} more step(s) drew an earlier batch again" if len(found) > 1 else ""
    return _check(
        "repeated_batch", False, f"steps {a} and {c} drew the same batch of {size} examples{more} ({odds})"
    )


def _near_repeat_check(part: ParticipationLedger, q: float, b: int, sizes: list[int], info: dict) -> dict:
    first, last = part.recorded_from, part.recorded_from + len(part.sizes)
    tests = _hypotheses(part.unobserved, first, last, b)
    alarm = math.log(REPEAT_FALSE_ALARM / max(tests, 1))
    expected = max(1, round(q * max(sizes)))
    shares = torch.arange(1, expected + 1)
    caught = torch.nonzero(log_upper_tail(expected, shares, q) <= alarm)
    power = int(caught[0]) + 1 if caught.numel() else None
    info.update(near_repeat_tests=tests, near_repeat_alarm_log_p=alarm, near_repeat_caught_share=power)
    sees = (
        f"a step that draws >= {power} of {expected} examples (the expected batch) at gap {b} is caught"
        if power is not None
        else f"no share of a batch of {expected} examples at one gap is visible at this run's size"
    )
    lags = torch.tensor(part.gap_lags, dtype=torch.int64, device="cpu").reshape(-1, GAPS_KEPT)
    counts = torch.tensor(part.gap_counts, dtype=torch.int64, device="cpu").reshape(-1, GAPS_KEPT)
    n = torch.tensor(part.sizes, dtype=torch.int64, device="cpu").reshape(-1, 1).expand_as(counts)
    valid = (counts > 0) & (lags > 0) & (lags % b == 0)
    if not bool(valid.any()):
        return _check(
            "near_repeat",
            True,
            f"no example took part again at a gap this sampler draws (multiples of {b}); {sees}",
        )
    logp = math.log(q) + (lags.double() / b - 1) * math.log1p(-q)
    tail = torch.where(valid, log_upper_tail(n.double(), counts.double(), logp.exp()), 0.0)
    i = int(tail.argmin())
    row, col = divmod(i, GAPS_KEPT)
    step, gap, c, size = first + 1 + row, int(lags[row, col]), int(counts[row, col]), int(part.sizes[row])
    worst = float(tail.reshape(-1)[i])
    info["worst"] = {"step": step, "gap": gap, "count": c, "size": size, "log_p": worst}
    said = (
        f"step {step} drew {c} of its {size} examples {gap} step(s) after their previous participation "
        f"(each with probability {math.exp(float(logp[row, col])):.3g} under Poisson sampling at q = {q:.6g}: "
        f"P(>= {c}) <= {math.exp(worst):.2g}; alarm below {math.exp(alarm):.2g}, false alarm "
        f"{REPEAT_FALSE_ALARM:g} over {tests} (step, gap) tests)"
    )
    if worst <= alarm:
        return _check("near_repeat", False, f"{said}: step {step - gap}'s batch drawn again, or most of it")
    return _check("near_repeat", True, f"the largest share at one gap: {said}; {sees}")


def reconcile(part: ParticipationLedger, plan, ledger, streams: int, steps: int, noise=None) -> dict:
    """The participation record against the plan and the privacy ``ledger`` after ``steps`` steps, when the
    variant's releases need ``streams`` noise streams (0 without noise): ``{"verdict": "consistent" |
    "MISMATCH: ...", "checks": [...], ...}`` with :meth:`ParticipationLedger.describe` beside. Callable at any
    step (each check is about the steps taken so far; the module docstring says what each one checks)."""
    checks = [_steps_check(part, steps), _batches_check(part)]
    rate, repeats, caveats = None, None, []
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
        if plan.sampler.kind in ("poisson", "cyclic_poisson"):
            found, repeats = repeat_checks(part, plan.sampler, steps)
            checks += found
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
    return _report(part, checks, rate, caveats, repeats)


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


def _report(
    part: ParticipationLedger,
    checks: list[dict],
    rate: dict | None,
    caveats: list[str],
    repeats: dict | None = None,
) -> dict:
    """The verdict (every failed check named, with its detail), the checks, the record, the rate test, the
    repeat tests and the caveats."""
    failed = [c for c in checks if not c["ok"]]
    verdict = (
        "consistent"
        if not failed
        else "MISMATCH: " + "; ".join(f"{c['check']}: {c['detail']}" for c in failed)
    )
    out = {"verdict": verdict, "checks": checks, **part.describe()}
    if rate is not None:
        out["rate_test"] = rate
    if repeats is not None:
        out["repeat_test"] = repeats
    if caveats:
        out["caveats"] = caveats
    return out
