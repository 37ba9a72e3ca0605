"""Welch's test of a gap between two cells (:mod:`dp_adam_bench.report.stats`) as the columns of a table of gaps:
the tables that list many comparisons (ganesh_fig3's seed section, the horizon study's gaps, mf_amplified's
winners) print each one's test and, where the seeds do not decide it, the seeds a cell that would.
"""

from __future__ import annotations

from dp_adam_bench.report import stats

#: the columns :func:`welch_columns` adds, in order
COLUMNS = ("se", "t", "df", "p", "decided (p < 0.05)", "seeds to decide")


def welch_columns(g: stats.Gap) -> dict[str, object]:
    """``g``'s standard error, Welch's t, df and p (None without a test), whether it is decided, and the seeds a
    cell that would decide it (blank when decided, "> 10,000" where even that many would not)."""
    if g.p is None:
        return dict.fromkeys(COLUMNS[:4]) | {COLUMNS[4]: f"no test: {g.untested()}", COLUMNS[5]: ""}
    return {
        "se": g.se,
        "t": g.t,
        "df": g.df,
        "p": g.p,
        COLUMNS[4]: "yes" if g.decided else "no",
        COLUMNS[5]: seeds_to_decide(g),
    }


def seeds_to_decide(g: stats.Gap) -> str:
    """The seeds a cell that would decide ``g`` (blank when it is decided or has no gap)."""
    if g.decided or g.diff == 0:
        return ""
    return str(g.seeds) if g.seeds else f"> {stats.MAX_SEEDS:,}"
