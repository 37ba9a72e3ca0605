"""Shared report plumbing: paper numbers, claim checks, and writing ``results/<id>.{csv,md}``.

Paper numbers are read from ``configs/paper/*.yaml`` and printed beside ours; they never feed back into
training or selection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import yaml

from dp_adam_bench.paths import PAPER_DIR
from dp_adam_bench.report import stats


def load_paper(name: str) -> dict:
    """Published numbers of one paper (``configs/paper/<name>.yaml``)."""
    path = PAPER_DIR / f"{name}.yaml"
    if not path.exists():
        valid = sorted(p.stem for p in PAPER_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no paper file {path}; valid names: {valid}")
    with open(path) as fh:
        return yaml.safe_load(fh)


#: a claim that the runs cannot check (the paper's own numbers only, a setting no profile runs)
NOT_CHECKED = "not checked"
#: a claim checked on a table that lacks runs its preset expects
INCOMPLETE = "incomplete"
#: every verdict a claim line can carry (:mod:`dp_adam_bench.report.stats`: five states of a comparison of our cells,
#: two of an exact quantity), then the two that are neither
VERDICTS = (*stats.STATES, *stats.EXACT, NOT_CHECKED, INCOMPLETE)


@dataclass(frozen=True)
class Claim:
    """A paper claim stated as a checkable inequality, and its state in our numbers (:data:`VERDICTS`).

    Build one with :meth:`compared` (a comparison of our cells: Welch's test over seeds), :meth:`exact` (an exact
    quantity against a tolerance whose reason it states) or :meth:`not_checked`. ``from_runs``: checked on numbers
    from runs (False for a check of the paper's own numbers or an exact computation), so it is ``incomplete`` while
    runs the preset expects are missing (:meth:`incomplete`).
    """

    text: str
    state: str
    detail: str = ""
    from_runs: bool = True
    missing: int = 0  # expected runs missing when it was checked: > 0 makes the verdict "incomplete"

    def __post_init__(self):
        if self.state not in VERDICTS[:-1]:
            raise ValueError(f"claim state {self.state!r} is not one of {VERDICTS[:-1]}")

    @classmethod
    def compared(
        cls, text: str, state: str, detail: str = "", *, from_runs: bool = True, not_independent: str = ""
    ) -> Claim:
        """A comparison of our cells in one of the five states (:func:`stats.state`, :func:`stats.combine`).
        ``not_independent``: why its test is not an independent one (the cells were chosen on the seeds it
        reads), said in the detail."""
        if state not in stats.STATES:
            raise ValueError(f"a comparison's state is one of {stats.STATES}, got {state!r}")
        if not_independent:
            detail = f"{detail}; not an independent test: {not_independent}" if detail else not_independent
        return cls(text, state, detail, from_runs)

    @classmethod
    def exact(cls, text: str, ok: bool, detail: str, why: str, *, from_runs: bool = False) -> Claim:
        """An exact quantity (an accountant, a deterministic value, a count of checked rows): ``matches`` when
        ``ok``, else ``differs``; ``why``: the tolerance and its reason, or why no test over seeds applies."""
        if not why:
            raise ValueError(f"an exact claim states why it is exact and its tolerance: {text!r}")
        detail = f"{detail}; exact: {why}" if detail else f"exact: {why}"
        return cls(text, stats.MATCHES if ok else stats.DIFFERS, detail, from_runs)

    @classmethod
    def not_checked(cls, text: str, detail: str = "", *, from_runs: bool = True) -> Claim:
        return cls(text, NOT_CHECKED, detail, from_runs)

    def incomplete(self, missing: int) -> Claim:
        """This claim checked on a table that lacks ``missing`` expected runs."""
        return replace(self, missing=missing) if self.from_runs and missing else self

    @property
    def verdict(self) -> str:
        return INCOMPLETE if self.missing else self.state

    @property
    def decided(self) -> bool:
        """Decided by the seeds (holds or contradicted) or exact (matches or differs)."""
        return self.state in (stats.HOLDS, stats.CONTRADICTED, *stats.EXACT)

    def line(self) -> str:
        detail = self.detail
        if self.missing:
            lacking = f"{self.missing} expected run{'s' if self.missing != 1 else ''} missing"
            detail = f"{lacking}; so far: {detail}" if detail else lacking
        return f"- {self.text}: **{self.verdict}**" + (f" ({detail})" if detail else "")


def fmt(x: object, digits: int = 4) -> str:
    """Format a number for a markdown table: empty for missing, scientific for tiny/huge values."""
    if x is None or x is pd.NA:
        return ""
    if isinstance(x, float):
        if math.isnan(x):
            return ""
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}f}"
    return str(x)


# CSV numbers keep this many significant digits (results/README rule): the FFT-based accountants (PRV, PLD) and
# BLAS reductions differ between machines in the 14th-16th digit, which made regenerated CSVs churn. 10 digits is
# far below every table's accuracy (accountant discretisation errors are >= 1e-6) and far above that noise.
CSV_SIGNIFICANT_DIGITS = 10


def round_significant(x: object, digits: int = CSV_SIGNIFICANT_DIGITS) -> object:
    """A float rounded to ``digits`` significant digits (NaN, inf and non-floats unchanged)."""
    if isinstance(x, float) and math.isfinite(x) and x != 0:
        return float(f"{x:.{digits}g}")
    return x


def write_csv(df: pd.DataFrame, path: Path, digits: int = CSV_SIGNIFICANT_DIGITS) -> Path:
    """``df`` as CSV with every float rounded to ``digits`` significant digits (:data:`CSV_SIGNIFICANT_DIGITS`), so
    a table regenerated on another machine is byte-identical."""
    rounded = df.copy()
    for col in rounded.columns:
        column = rounded[col]
        if column.dtype == object:  # mixed columns: keep each value's type (an int stays an int)
            rounded[col] = pd.Series(
                [round_significant(v, digits) for v in column], index=column.index, dtype=object
            )
        elif pd.api.types.is_float_dtype(column.dtype):
            rounded[col] = column.map(lambda v: round_significant(v, digits))
    rounded.to_csv(path, index=False)
    return Path(path)


def markdown_table(df: pd.DataFrame, digits: int = 4) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    # column by column: a row of an all-numeric frame (iterrows) would turn its integers into floats ("64.0000")
    values = [df[c].tolist() for c in cols]
    for i in range(len(df)):
        lines.append("| " + " | ".join(fmt(v[i], digits) for v in values) + " |")
    return "\n".join(lines)


def write_table(
    table_id: str,
    df: pd.DataFrame,
    *,
    out: Path,
    title: str,
    command: str,
    setting: str = "",
    claims: Sequence[Claim] = (),
    notes: Sequence[str] = (),
    figure: Path | None = None,
    digits: int = 4,
    extra_sections: Sequence[tuple[str, str]] = (),
    missing: Sequence[str] = (),
) -> list[Path]:
    """Write ``<out>/<table_id>.csv`` and ``<out>/<table_id>.md``; return the paths written.

    The markdown opens with the command that regenerates it, then the setting, the table (paper beside ours),
    the claim checks and the notes. ``missing``: the runs the preset expects and the table lacks
    (:mod:`dp_adam_bench.report.expected`); with any, every claim checked on runs is ``incomplete`` and a section
    lists them.
    """
    claims = [c.incomplete(len(missing)) for c in claims]
    if missing:
        extra_sections = [
            *extra_sections,
            (
                f"Missing runs ({len(missing)}: the claims above are incomplete until they are complete)",
                "\n".join(f"- `{m}`" for m in missing),
            ),
        ]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / f"{table_id}.csv"
    md_path = out / f"{table_id}.md"
    write_csv(df, csv_path)
    parts = [f"# {title}", "", f"Regenerate: `{command}`", ""]
    if setting:
        parts += [f"Setting: {setting}", ""]
    parts += [markdown_table(df, digits), ""]
    if claims:
        parts += ["## Paper claims checked here", ""] + [c.line() for c in claims] + [""]
    for heading, body in extra_sections:
        parts += [f"## {heading}", "", body, ""]
    if figure is not None:
        parts += [f"![{table_id}]({figure.name})", ""]
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    md_path.write_text("\n".join(parts))
    written = [csv_path, md_path]
    if figure is not None:
        written.append(figure)
    return written


def save_figure(fig, table_id: str, out: Path) -> Path:
    """Write ``<out>/<table_id>.png`` and close the figure."""
    import matplotlib.pyplot as plt

    path = Path(out) / f"{table_id}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def incomplete_note(incomplete) -> list[str]:
    """The note listing runs left out because they have no complete summary (none: no note)."""
    return ["Incomplete runs left out: " + ", ".join(r.path.name for r in incomplete)] if incomplete else []
