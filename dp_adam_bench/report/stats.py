"""The one statistical rule every report applies to a claim: five states for a comparison of our cells over seeds,
two for an exact quantity.

A table cell is the mean of a metric over ``n`` seeds. An ordering claim ("A beats B") compares two cells; whether
the seeds can decide it is Welch's unequal-variance t-test (Welch 1947, Biometrika 34(1-2)), with its
Welch-Satterthwaite degrees of freedom, two-sided at :data:`LEVEL`. Two seeds a cell give 1-2 degrees of freedom,
where a gap of 2 standard errors is p ~ 0.13-0.24: "beyond 2 SE" is no test at that size, so no report uses it.

* **Spread.** Every std a report prints or writes to a CSV is the *sample* standard deviation over seeds
  (ddof = 1, :data:`STD_CONVENTION`); CSV columns carrying one end in :data:`STD_SUFFIX`, so the header names it.
* **States** (:func:`state`). A comparison of our cells is :data:`HOLDS` (the paper's direction, Welch's
  p < :data:`LEVEL`, its degrees of freedom printed), :data:`AGREES` (the paper's direction, p >= LEVEL),
  :data:`DISAGREES` (the other direction, p >= LEVEL), :data:`CONTRADICTED` (the other direction, p < LEVEL) or
  :data:`UNTESTED` (fewer than 2 seeds a cell, or a value not finite). Where the cells' hyper-parameters were chosen
  on the very seeds the test reads, no p is an independent test: the claim agrees or disagrees, never more. A claim
  made of several comparisons (every row, a chain a > b > c) holds only if each part holds (:func:`combine`).
* **Exact quantities** (an accountant's epsilon, a deterministic value, a count of audited rows) are
  :data:`MATCHES` or :data:`DIFFERS` against a tolerance whose reason the claim states.
* **Seeds to decide.** Where two cells cannot be told apart, :func:`seeds_to_decide` says how many seeds a cell
  would, *if the gap and the spread seen were the truth* (the smallest n per cell at which that gap gives
  p < LEVEL). It is always more than the seeds already run: the count already run never "suffices".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from scipy import stats as _scipy_stats

#: two-sided significance level of every ordering claim
LEVEL = 0.05
#: the spread every report prints: the sample standard deviation over seeds
STD_CONVENTION = "sample std over seeds (ddof = 1)"
#: the suffix of every CSV column that holds a spread (the header names the convention)
STD_SUFFIX = "_sample_std"
#: the five states of a comparison of our cells (:func:`state`)
HOLDS = "holds"
AGREES = "agrees, not decided"
DISAGREES = "disagrees, not decided"
CONTRADICTED = "contradicted"
UNTESTED = "untested"
STATES = (HOLDS, AGREES, DISAGREES, CONTRADICTED, UNTESTED)
#: the two states of an exact quantity against a stated tolerance
MATCHES = "matches"
DIFFERS = "differs"
EXACT = (MATCHES, DIFFERS)
#: the most seeds a cell :func:`seeds_to_decide` looks for before it says "more than"
MAX_SEEDS = 10_000


def sample_std(values: Sequence[float]) -> float | None:
    """The sample standard deviation (ddof = 1) of ``values``; None with fewer than 2 (one seed has no spread)."""
    vals = [float(v) for v in values]
    if len(vals) < 2:
        return None
    mean = math.fsum(vals) / len(vals)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def sample_from_population_std(std: float | None, n: int) -> float | None:
    """The sample std of ``n`` values from their population std (ddof = 0); None for n < 2 or no std."""
    if std is None or n < 2 or not math.isfinite(std):
        return None
    return std * math.sqrt(n / (n - 1))


def _welch_df(va: float, na: int, vb: float, nb: int) -> float:
    """Welch-Satterthwaite degrees of freedom of two means with sample variances ``va``, ``vb``."""
    a, b = va / na, vb / nb
    if a + b == 0:
        return float(na + nb - 2)
    # a side without variance (a number, not a cell) adds nothing to the denominator
    return (a + b) ** 2 / ((a**2 / (na - 1) if a else 0.0) + (b**2 / (nb - 1) if b else 0.0))


def _p_value(diff: float, va: float, na: int, vb: float, nb: int) -> tuple[float, float, float, float]:
    """(se, t, df, two-sided p) of Welch's test of ``diff`` = mean_a - mean_b."""
    se = math.sqrt(va / na + vb / nb)
    df = _welch_df(va, na, vb, nb)
    if se == 0:  # identical seeds: any gap is exact, none is no evidence
        return 0.0, (math.copysign(math.inf, diff) if diff else 0.0), df, (0.0 if diff else 1.0)
    t = diff / se
    return se, t, df, float(2 * _scipy_stats.t.sf(abs(t), df))


@dataclass(frozen=True)
class Gap:
    """Cell a minus cell b over seeds, judged by Welch's t-test (:mod:`dp_adam_bench.report.stats`).

    ``se``, ``t``, ``df``, ``p`` are None when a cell has fewer than 2 seeds or a value is not finite (a diverged
    run): then the seeds cannot decide anything and :attr:`decided` is False.
    """

    diff: float
    n_a: int
    n_b: int
    se: float | None = None
    t: float | None = None
    df: float | None = None
    p: float | None = None
    seeds: int | None = None  # seeds a cell that would decide this gap (None: decided, or cannot say)
    unit: str = "seeds"  # what a cell averages over ("trials" where one run's trials are the repetitions)
    threshold: str | None = None  # against a number, not a cell (:func:`against`): the number as printed

    @property
    def decided(self) -> bool:
        """The seeds tell the two cells apart: Welch's two-sided p < :data:`LEVEL`."""
        return self.p is not None and self.p < LEVEL

    def test(self) -> str:
        """The test in words: ``t = 2.31 (Welch, df 1.8), p = 0.16 over 2 / 2 seeds``."""
        over = (
            f"{self.n_a} / {self.n_b} {self.unit}"
            if self.threshold is None
            else f"{self.n_a} {self.unit} against {self.threshold}"
        )
        if self.p is None:
            return f"no test: {over}" + ("" if math.isfinite(self.diff) else ", a value not finite")
        t = f"{self.t:+.2f}" if math.isfinite(self.t) else ("+inf" if self.t > 0 else "-inf")
        return f"t = {t} (Welch, df {self.df:.1f}), p = {format_p(self.p)} over {over}"

    @property
    def one_seed(self) -> bool:
        """A cell has fewer than 2 seeds (or trials): there is no spread to test a gap against."""
        return min(self.n_a, self.n_b) < 2

    def untested(self) -> str | None:
        """Why there is no test (one seed a cell, or a value not finite); None when there is one."""
        if self.p is not None:
            return None
        return f"fewer than 2 {self.unit} a cell" if self.one_seed else "a value not finite"

    def flag(self) -> str:
        """``""`` when decided or untested (:meth:`test` says why there is no test); else how many seeds a cell
        would decide it."""
        if self.decided or self.p is None:
            return ""
        need = (
            f"~{self.seeds} {self.unit} a cell would decide it if the gap and spread seen were the truth"
            if self.seeds
            else (
                "no gap to decide"
                if self.diff == 0
                else f"more than {MAX_SEEDS:,} {self.unit} a cell would be needed at the spread seen"
            )
        )
        return f"not decided: p = {format_p(self.p)} >= {LEVEL:g} by Welch's t; {need}"


def format_p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def welch(
    mean_a: float,
    std_a: float | None,
    n_a: int,
    mean_b: float,
    std_b: float | None,
    n_b: int,
    unit: str = "seeds",
) -> Gap:
    """Welch's t-test of mean_a - mean_b from each cell's mean, *sample* std and count of ``unit``."""
    diff = float(mean_a) - float(mean_b)
    finite = all(x is not None and math.isfinite(x) for x in (mean_a, mean_b, std_a, std_b))
    if n_a < 2 or n_b < 2 or not finite:
        return Gap(diff, n_a, n_b, unit=unit)
    va, vb = float(std_a) ** 2, float(std_b) ** 2
    se, t, df, p = _p_value(diff, va, n_a, vb, n_b)
    seeds = None if p < LEVEL else seeds_to_decide(diff, std_a, std_b, start=max(n_a, n_b))
    return Gap(diff, n_a, n_b, se=se, t=t, df=df, p=p, seeds=seeds, unit=unit)


def compare(values_a: Sequence[float], values_b: Sequence[float], unit: str = "seeds") -> Gap:
    """Welch's t-test of mean(a) - mean(b) over the seeds' (or ``unit``'s) values."""
    a, b = [float(v) for v in values_a], [float(v) for v in values_b]
    if not a or not b:
        raise ValueError(f"compare needs values on both sides, got {len(a)} and {len(b)}")
    mean = lambda v: math.fsum(v) / len(v)  # noqa: E731
    return welch(mean(a), sample_std(a), len(a), mean(b), sample_std(b), len(b), unit)


def seeds_to_decide(diff: float, std_a: float, std_b: float, *, start: int) -> int | None:
    """The smallest n > ``start`` seeds per cell at which a gap ``diff`` with sample stds ``std_a``, ``std_b`` gives
    Welch's p < :data:`LEVEL`; None when there is no gap, a value is not finite, or it takes more than
    :data:`MAX_SEEDS`. Never the count already run: a gap those seeds do not decide needs more."""
    if diff == 0 or not all(math.isfinite(x) for x in (diff, std_a, std_b)):
        return None
    va, vb = std_a**2, std_b**2
    return _first_deciding(lambda n: _p_value(diff, va, n, vb, n)[3] < LEVEL, start)


def _first_deciding(decides, start: int) -> int | None:
    """The smallest n > ``start`` (at most :data:`MAX_SEEDS`) with ``decides(n)``; p falls as n grows, so bisect."""
    if not decides(MAX_SEEDS):
        return None
    lo, hi = max(start, 1), MAX_SEEDS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if decides(mid):
            hi = mid
        else:
            lo = mid
    return hi


def state(g: Gap, *, strict: bool = True, independent: bool = True) -> str:
    """The state of a comparison whose ``g.diff > 0`` is the paper's direction (``>= 0`` when not ``strict``: a tie
    is the paper's "at least"). ``independent``: False where the cells' hyper-parameters were chosen on the seeds
    the test reads, so that p is no independent test and the claim is at most agreed or disagreed with."""
    if g.p is None:
        return UNTESTED
    agree = g.diff > 0 if strict else g.diff >= 0
    if g.decided and independent:
        return HOLDS if agree else CONTRADICTED
    return AGREES if agree else DISAGREES


def combine(states: Sequence[str]) -> str:
    """The state of a claim made of several comparisons that must all go the paper's way (every row, a chain
    a > b > c): contradicted by any contradicted part, held only when every part holds, untested where a part is
    untested, else not decided: disagrees where a part does, agrees where every part does."""
    states = list(states)
    if not states:
        raise ValueError("combine needs at least one state")
    bad = [s for s in states if s not in STATES]
    if bad:
        raise ValueError(f"combine takes the states of comparisons {STATES}, got {bad}")
    if CONTRADICTED in states:
        return CONTRADICTED
    if all(s == HOLDS for s in states):
        return HOLDS
    if UNTESTED in states:
        return UNTESTED
    return DISAGREES if DISAGREES in states else AGREES


def against(mean: float, std: float | None, n: int, threshold: float, unit: str = "seeds") -> Gap:
    """Welch's test of ``mean - threshold`` where the threshold is a number, not a cell: Welch-Satterthwaite with the
    other side's variance 0, i.e. the one-sample t-test on n - 1 degrees of freedom."""
    diff = float(mean) - float(threshold)
    name = f"{threshold:.4g}"
    if n < 2 or std is None or not all(math.isfinite(x) for x in (mean, std, threshold)):
        return Gap(diff, n, n, unit=unit, threshold=name)
    va = float(std) ** 2
    se, t, df, p = _p_value(diff, va, n, 0.0, 1)
    seeds = None
    if p >= LEVEL and diff != 0 and se > 0:
        seeds = _first_deciding(lambda k: _p_value(diff, va, k, 0.0, 1)[3] < LEVEL, n)
    return Gap(diff, n, n, se=se, t=t, df=df, p=p, seeds=seeds, unit=unit, threshold=name)


def flipped(g: Gap) -> Gap:
    """``g`` read the other way round (b - a): its difference and t change sign, its test does not."""
    return replace(g, diff=-g.diff, t=None if g.t is None else -g.t)
