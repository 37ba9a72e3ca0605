"""The shape most tables share, in one place: select the runs, group them into cells, put the paper's numbers
beside ours, state the paper's orderings with the one statistical rule (:mod:`dp_adam_bench.report.stats`), then
notes, figure, csv and md (:func:`dp_adam_bench.report.common.write_table`).

A builder on this skeleton reads, top to bottom::

    found = complete_runs(ctx, table_id, command)            # the preset's runs, or one line saying what to run
    cells = {key: SeedStats.of(values), ...}                # one cell per row of the table, over seeds
    frame = pd.DataFrame(rows)                              # paper beside ours, ours_sample_std, n
    claims = ordering_claims(ORDERINGS, cells, ...)         # each in one of the five states, with its Welch test
    notes = rule_notes(claims) + [...] + run_folder_notes(found)  # the rule first, then the table's
    return Table(table_id, title, command, frame, ...).write(ctx.out)

Claims read the cells' (mean, sample std, n), the numbers the CSV holds, never the runs themselves: anyone can
recheck a claim from the table alone (:func:`SeedStats.from_row`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from dp_adam_bench.report import stats
from dp_adam_bench.report.common import Claim, incomplete_note, write_table
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.expected import PresetRuns, preset_runs


@dataclass(frozen=True)
class SeedStats:
    """One cell over its seeds: the mean, the sample std (:data:`stats.STD_CONVENTION`; None for one seed) and the
    number of seeds."""

    mean: float
    std: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> SeedStats:
        vals = [float(v) for v in values]
        if not vals:
            raise ValueError("a cell needs at least one seed's value")
        return cls(math.fsum(vals) / len(vals), stats.sample_std(vals), len(vals))

    @classmethod
    def from_row(cls, row: Mapping, mean: str = "ours", std: str = f"ours{stats.STD_SUFFIX}") -> SeedStats:
        """The cell a table's CSV row holds (``row[mean]``, ``row[std]``, ``row["n"]``)."""
        sd = row.get(std)
        sd = None if sd is None or (isinstance(sd, float) and math.isnan(sd)) else float(sd)
        return cls(float(row[mean]), sd, int(row["n"]))


def gap(a: SeedStats, b: SeedStats, over: str = "seeds") -> stats.Gap:
    """Welch's test of a.mean - b.mean (:func:`stats.welch`); ``over``: what the cells average over."""
    return stats.welch(a.mean, a.std, a.n, b.mean, b.std, b.n, unit=over)


def versus(cell: SeedStats, threshold: float, *, above: bool, over: str = "seeds") -> stats.Gap:
    """Welch's test of a cell against a number (:func:`stats.against`), its difference positive in the claimed
    direction (``above``: the cell above the number)."""
    g = stats.against(cell.mean, cell.std, cell.n, threshold, unit=over)
    return g if above else stats.flipped(g)


def within(cell: SeedStats, lo: float, hi: float, over: str = "seeds") -> stats.Gap:
    """A cell inside the band [lo, hi]: the test against the nearer end, positive inside (the binding one of the two
    one-sided tests of an equivalence claim)."""
    if abs(cell.mean - lo) <= abs(hi - cell.mean):
        return versus(cell, lo, above=True, over=over)
    return versus(cell, hi, above=False, over=over)


@dataclass(frozen=True)
class Ordering:
    """A paper's ordering claim between two cells: ``better`` ahead of ``worse`` (by a larger mean, or a smaller one
    with ``lower_is_better``). ``strict``: a tie is not the paper's direction. ``paper``: what the paper reports
    for it (printed in the claim's detail). ``not_independent``: why the cells' test is not an independent one
    (their hyper-parameters were chosen on the seeds it reads): then the claim agrees or disagrees, never more."""

    better: Hashable
    worse: Hashable
    text: str
    strict: bool = True
    paper: str = ""
    lower_is_better: bool = False
    not_independent: str = ""


def ordering_claim(
    o: Ordering, better: SeedStats, worse: SeedStats, *, unit: str = "", digits: int = 2, over: str = "seeds"
) -> Claim:
    """The claim ``o`` checked on two cells, in one of the five states (:func:`stats.state`): its detail gives the
    means, the margin and Welch's test (t > 0 in the paper's order; ``over``: what a cell averages over), and where
    the seeds do not decide it, the seeds a cell that would."""
    g = (
        gap(worse, better, over) if o.lower_is_better else gap(better, worse, over)
    )  # t > 0: the paper's order
    state = stats.state(g, strict=o.strict, independent=not o.not_independent)
    u = f" {unit}" if unit else ""
    parts = [
        f"{better.mean:.{digits}f} vs {worse.mean:.{digits}f}{u}, margin {g.diff:+.{digits}f}",
        g.test(),
    ]
    if o.paper:
        parts.append(f"paper: {o.paper}")
    if g.flag():
        parts.append(g.flag())
    return Claim.compared(o.text, state, "; ".join(parts), not_independent=o.not_independent)


def ordering_claims(
    orderings: Sequence[Ordering],
    cells: Mapping[Hashable, SeedStats],
    *,
    unit: str = "",
    digits: int = 2,
    prefix: str = "",
) -> list[Claim]:
    """Every ordering whose two cells the table has (one without both cells is not checked, so it is left out)."""
    out = []
    for o in orderings:
        if o.better in cells and o.worse in cells:
            claim = ordering_claim(o, cells[o.better], cells[o.worse], unit=unit, digits=digits)
            out.append(replace(claim, text=prefix + claim.text) if prefix else claim)
    return out


def within_noise(claim: Claim) -> bool:
    """Whether the seeds leave a comparison undecided: agrees or disagrees, not decided, or untested."""
    return claim.state in (stats.AGREES, stats.DISAGREES, stats.UNTESTED)


#: why a claim that a tuned value was chosen inside its grid is exact (:meth:`Claim.exact`)
GRID_EXACT = (
    "which grid value the tuning chose is a fact of its runs, no test over seeds; inside = strictly between the "
    "grid's two ends"
)


#: the opening words of the notes :func:`rule_notes` writes, now and under the rules before (a re-statement
#: replaces every note that opens so)
RULE_NOTE_OPENINGS = ("Verdicts (", "No comparison above", "Claims: 'holds' when", "No ordering above")


def noise_note(claims: Sequence[Claim], what: str = "the optimizers") -> list[str]:
    """The note a table gets when none of its comparisons is decided by its seeds: untested (one seed a cell) or,
    where some are tested, not decided by Welch's t."""
    compared = [c for c in claims if c.state in stats.STATES]
    if not compared or not all(within_noise(c) for c in compared):
        return []
    if all(c.state == stats.UNTESTED for c in compared):
        return [
            "No comparison above can be tested (each says why: one seed a cell, or no spread over seeds kept), so "
            "this profile neither reproduces nor contradicts the paper's orderings."
        ]
    return [
        f"No comparison above is decided by the seeds (Welch's t: p >= {stats.LEVEL:g}, or no test, for every "
        f"one): at this budget {what} are indistinguishable, so this profile neither reproduces nor contradicts "
        "the paper's orderings."
    ]


def rule_notes(claims: Sequence[Claim], what: str = "the optimizers") -> list[str]:
    """The notes that word the rule, first in a table's notes: the rule, then :func:`noise_note`."""
    return [rule_note(), *noise_note(claims, what)]


def restated_rule_notes(
    old: Sequence[str], claims: Sequence[Claim], old_rule: Sequence[str], what: str = "the optimizers"
) -> list[str]:
    """A re-stated table's notes (:mod:`dp_adam_bench.report.restate`): :func:`rule_notes` first, then the old
    notes less those that worded the old rule (each opening with one of ``old_rule``) and those that word this
    one (:data:`RULE_NOTE_OPENINGS`)."""
    openings = (*RULE_NOTE_OPENINGS, *old_rule)
    return rule_notes(claims, what) + [n for n in old if not n.startswith(openings)]


def rule_note() -> str:
    """The rule in one line, for a table's notes."""
    return RULE_NOTE


#: the rule in one line (:mod:`dp_adam_bench.report.stats`)
RULE_NOTE = (
    f"Verdicts (dp_adam_bench/report/stats.py): a comparison of our cells *holds* when its means are in the "
    f"paper's direction and Welch's t-test (two-sided, Welch-Satterthwaite degrees of freedom, printed) gives "
    f"p < {stats.LEVEL:g}; it is *agrees, not decided* or *disagrees, not decided* with p >= {stats.LEVEL:g} (with "
    "the seeds a cell that would decide it if the gap and spread seen were the truth), *contradicted* against the "
    f"paper's direction with p < {stats.LEVEL:g}, and *untested* with fewer than 2 seeds a cell; cells whose "
    "hyper-parameters were chosen on the seeds the test reads are at most agreed or disagreed with. An exact "
    "quantity *matches* or *differs* against the tolerance it states. Spreads are the "
    f"{stats.STD_CONVENTION}."
)


def complete_runs(ctx: ReportContext, table_id: str, command: str, preset: str | None = None) -> PresetRuns:
    """The runs of ``preset`` (default ``table_id``); FileNotFoundError naming the command when none is complete."""
    found = preset_runs(ctx, preset or table_id)
    if not found.complete:
        raise FileNotFoundError(
            f"no complete runs in {ctx.where(found.spec.name)}; run `{command}` (or `dp-adam-bench sweep "
            f"{preset or table_id} --profile {ctx.profile}`)"
        )
    return found


def run_folder_notes(found: PresetRuns) -> list[str]:
    """What the run folders say of themselves (their privacy notes, runs that are not private), then the runs left
    out as incomplete."""
    complete = found.complete
    notes = [
        f"From the run folders: {n}"
        for n in sorted({n for r in complete for n in r.summary.get("privacy_notes", [])})
    ]
    if any(not r.summary.get("private", True) for r in complete):
        notes.append("Some runs are NOT private (they use clean statistics): see their summary.json.")
    return notes + incomplete_note(found.incomplete)


@dataclass
class Table:
    """Everything one table writes: ``<out>/<table_id>.{csv,md}`` (and its figure)."""

    table_id: str
    title: str
    command: str
    frame: pd.DataFrame
    setting: str = ""
    claims: Sequence[Claim] = ()
    notes: Sequence[str] = ()
    figure: Path | None = None
    digits: int = 4
    missing: Sequence[str] = ()
    extra_sections: Sequence[tuple[str, str]] = field(default_factory=list)

    def write(self, out: Path) -> list[Path]:
        return write_table(
            self.table_id,
            self.frame,
            out=out,
            title=self.title,
            command=self.command,
            setting=self.setting,
            claims=self.claims,
            notes=self.notes,
            figure=self.figure,
            digits=self.digits,
            extra_sections=self.extra_sections,
            missing=self.missing,
        )
