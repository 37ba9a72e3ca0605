"""Where the CPU ``ganesh_fig3`` table differs from Ganesh, McMahan & Thakurta's Fig. 3 (arXiv:2507.01129, §5.2),
and what this repository's own runs say about why: one section of the ganesh_fig3 report, written from the numbers
of that report (its claims and their Welch tests, the effective steps) and of the horizon study
(``results/ganesh_fig3_horizon.md``), never from fixed text about them.

Three readings, each from its own evidence:

* **which claims differ and by how much**: every Fig. 3 statement that the paper's numbers support and ours do
  not, with its Welch test over seeds (:mod:`dp_adam_bench.report.stats`);
* **why the rows tie at the CPU horizon**: where the clean second moment is a vanishing fraction of the noise
  variance Phi, every Adam variant is DP-SGD with momentum at its own effective step (the effective-steps section);
* **what the number of steps changes**: each gap of the horizon study at every horizon it ran.
"""

from __future__ import annotations

import pandas as pd

from dp_adam_bench.report import stats
from dp_adam_bench.report.common import Claim
from dp_adam_bench.report.ganesh_steps import STEP
from dp_adam_bench.report.skeleton import within_noise

OURS, PAPER = "[ours] ", "[paper] "


def differing_claims(claims: list[Claim]) -> list[tuple[Claim, Claim]]:
    """(ours, paper) for every statement checked on both tables that goes another way here: true of the paper's
    numbers (matches) and against it in ours (disagrees or contradicted), or the reverse; an untested one of ours
    goes no way."""
    paper = {c.text.removeprefix(PAPER): c for c in claims if c.text.startswith(PAPER)}
    out = []
    for c in claims:
        theirs = paper.get(c.text.removeprefix(OURS)) if c.text.startswith(OURS) else None
        if theirs is None or c.state == stats.UNTESTED:
            continue
        if (c.state in (stats.HOLDS, stats.AGREES)) != (theirs.state == stats.MATCHES):
            out.append((c, theirs))
    return out


def decided(claim: Claim) -> bool | None:
    """Whether the seeds decide one of ganesh_fig3's claims on our cells (holds or contradicted); None where it
    has no test (untested)."""
    if claim.state == stats.UNTESTED:
        return None
    return not within_noise(claim)


def differs_section(
    claims: list[Claim], reading: str, gaps: pd.DataFrame | None, heldout: pd.DataFrame | None = None
) -> str:
    """The section's markdown: the differing claims, the effective-step ``reading`` (:func:`step_reading`), the
    horizon gaps (``heldout``: the same gaps on the horizon study's held-out seeds)."""
    both = [
        c for c in claims if c.text.startswith(OURS) and c.text.removeprefix(OURS) in _texts(claims, PAPER)
    ]
    differ = differing_claims(claims)
    if not differ:
        return f"Every one of the {len(both)} statements checked on both tables has the paper's verdict here."
    lines = [
        f"**{len(differ)} of {len(both)} statements have another verdict here than on the paper's numbers:**",
        "",
    ]
    for ours, theirs in differ:
        lines.append(
            f"- {ours.text.removeprefix(OURS)}: on the paper's numbers {_truth(theirs)} ({theirs.detail}); here "
            f"{ours.verdict} ({ours.detail})"
        )
    lines += ["", *_noise_sentence([decided(ours) for ours, _ in differ]), reading]
    if gaps is not None and len(gaps):
        lines += ["", _horizon_reading(gaps)]
    if heldout is not None and len(heldout):
        lines += [
            "",
            "On seeds no choice saw (the horizon study's held-out seeds): " + _per_gap(heldout) + ".",
        ]
    return "\n".join(lines).strip()


def _truth(paper_claim: Claim) -> str:
    """A statement checked on the paper's printed numbers, in words: true (matches) or false (differs)."""
    return "true" if paper_claim.state == stats.MATCHES else "false"


def _noise_sentence(seen: list[bool | None]) -> list[str]:
    """Whether the seeds decide the differing claims: a paragraph and its blank line (none where one states no
    test)."""
    if not seen or None in seen:
        return []
    if not any(seen):
        return [
            f"None of them is beyond seed noise (Welch's t, p >= {stats.LEVEL:g} for each): at this horizon and "
            "seed count the table does not order these rows, and the seed section says how many seeds a cell "
            "would decide each.",
            "",
        ]
    return [f"{sum(seen)} of them are beyond seed noise (Welch's t, p < {stats.LEVEL:g}).", ""]


def step_paragraph(section: str) -> str:
    """The effective-step reading in a section :func:`differs_section` wrote (a re-statement keeps it: it reads the
    runs' diagnostics, not the rule)."""
    return next(p for p in section.split("\n\n") if p.startswith(STEP_READINGS))


def _texts(claims: list[Claim], prefix: str) -> set[str]:
    return {c.text.removeprefix(prefix) for c in claims if c.text.startswith(prefix)}


RATIO = "median clean v / Phi"  # a column of ganesh_steps.effective_steps
#: below this clean v / Phi in every Adam run, v^ is read as noise (the CPU table: <= 1.2e-7)
NOISE_ONLY = 0.01
#: the first words of each reading :func:`step_reading` writes
STEP_READINGS = (
    "Why the private rows are so close here",
    "The median clean second moment",
    "(No second moments logged",
)


def step_reading(steps: pd.DataFrame) -> str:
    """Why the private rows tie: the clean v against Phi, and the spread of the rows' effective steps."""
    if steps is None or not len(steps) or RATIO not in steps:
        return "(No second moments logged: the effective-step reading needs the runs' diagnostics.)"
    ratio = steps[RATIO].dropna()
    if not len(ratio) or ratio.max() >= NOISE_ONLY:
        worst = f"{ratio.max():.2g}" if len(ratio) else "not logged"
        return (
            f"The median clean second moment against the noise variance Phi, at most: {worst}. Above "
            f"{NOISE_ONLY:g} the Adam variants' preconditioners carry clean signal, so the effective-step reading "
            "(v^ is noise, every variant a DP-SGD with momentum) does not explain the table here."
        )
    by_row = steps.groupby("row")[STEP].agg(["min", "max"])
    spans = "; ".join(
        f"{row} {lo:.2g}" + ("" if abs(hi - lo) < 0.05 * max(abs(lo), 1e-12) else f" to {hi:.2g}")
        for row, (lo, hi) in by_row.iterrows()
    )
    return (
        f"Why the private rows are so close here: in every Adam run the median clean second moment is at most "
        f"{ratio.max():.1g} of the noise variance Phi (the effective-steps section), so v^ is noise and every "
        "Adam variant moves as DP-SGD with momentum does, at its own effective step (median coordinate, across "
        f"the columns: {spans}). The rows differ by how far they step. The paper's reason for STP's advantage, a "
        "preconditioner that keeps the noiseless geometry (Ganesh et al. §4.3), has almost no clean signal to "
        "follow here (STP is not in that table, its steps being in scaled units: the STP note below)."
    )


def _horizon_reading(gaps: pd.DataFrame) -> str:
    """Each gap at every horizon run, from the horizon study's gap table."""
    return (
        "What more steps change (results/ganesh_fig3_horizon.md: the same epsilon at every horizon, the learning "
        "rate tuned at each on val abstracts; the paper finds every gap negative): " + _per_gap(gaps) + "."
    )


def _per_gap(gaps: pd.DataFrame) -> str:
    parts = []
    for _, g in gaps.groupby("gap", sort=False):
        per = ", ".join(
            f"{int(s)} steps {d:+.3f}"
            + ("" if pd.isna(se) else f" ± {se:.3f}")
            + f" ({'' if pd.isna(p) else f'p = {stats.format_p(p)}, '}{v})"
            for s, d, se, p, v in zip(g.steps, g.difference, g.se, g.p, g.verdict, strict=True)
        )
        parts.append(f"{g.what.iloc[0]}: {per}")
    return "; ".join(parts)
