"""Re-state a committed table under the shared statistical rule (:mod:`dp_adam_bench.report.stats`) from its own
CSV, when the runs behind it are not at hand.

A table on the skeleton (:mod:`dp_adam_bench.report.skeleton`) checks its claims on its cells' mean, sample std and
seed count, the numbers its CSV holds. So a table written under an older rule can be re-stated without re-running:
its spread columns are renamed to the named convention (:data:`stats.STD_SUFFIX`, a population std turned into the
sample std with its n), its ordering claims are checked again by the builder's own function, the notes that word
the rule are the builder's own, and everything else in the md (title, command, setting, other claims, sections,
figure, the other notes) is kept as the runs wrote it. A line in the notes says the table was re-stated so.

``python -m dp_adam_bench.report.restate TABLE [--results DIR]``; re-stating a re-stated table changes nothing.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from dp_adam_bench.report import stats
from dp_adam_bench.report.common import INCOMPLETE, VERDICTS, Claim, write_table

CLAIMS_HEADING = "## Paper claims checked here"
NOTES_HEADING = "## Notes"
RESTATED = (
    "Re-stated from this table's own CSV (and md) under the shared rule (dp_adam_bench/report/stats.py: five "
    "states by Welch's t, sample std; exact quantities against a stated tolerance), its runs not re-run: "
    "`python -m dp_adam_bench.report.restate {table}`. The numbers are the runs'; the claim lines and the notes "
    "that word the rule are new."
)
#: the notes that said so under the rules before (replaced by :data:`RESTATED`)
OLD_RESTATED = (
    "Re-stated from this table's CSV under the shared rule (dp_adam_bench/report/stats.py: Welch's t, sample "
    "std), its runs not re-run: `python -m dp_adam_bench.report.restate {table}`. The numbers are the runs'; the "
    "claim lines and the notes that word the rule are new.",
)


@dataclass(frozen=True)
class Restatement:
    """How one table is re-stated.

    ``spreads``: old CSV column -> (new column, "population" or "sample": what the old column held).
    ``claims``: the builder's claims from its frame (the ordering claims it re-checks; a claim line of the md
    whose text it does not produce is kept as written). ``notes``: (the md's old notes, the new claims) -> the
    notes, the builder's rule wording in place of the old.
    """

    table: str
    spreads: Mapping[str, tuple[str, str]]
    claims: Callable[[pd.DataFrame], list[Claim]]
    notes: Callable[[list[str], list[Claim]], list[str]]
    digits: int = 4
    text: tuple[str, ...] = ()  # columns the builder writes as text ("0.001", not 0.001): read back as text
    #: (frame, the md's (heading, body) sections) -> the sections; None keeps them as they are. For a section the
    #: builder computes from the table's cells (a table of gaps), it returns the section as the builder writes it.
    sections: Callable[[pd.DataFrame, list[tuple[str, str]]], list[tuple[str, str]]] | None = None
    #: exact claims the builder does not re-check from the CSV (their inputs are not in it): claim-text prefix ->
    #: why the claim is exact (its tolerance and reason, :meth:`Claim.exact`). An old line of one keeps its
    #: detail, its verdict turned into matches / differs (an exact quantity's verdict is the same under every rule)
    exact: Mapping[str, str] = field(default_factory=dict)
    #: (frame, the notes :attr:`notes` gave) -> the notes, for notes the builder computes from the table's cells
    frame_notes: Callable[[pd.DataFrame, list[str]], list[str]] | None = None

    def restate(self, results: Path) -> list[Path]:
        return apply(self, results)


#: table id -> its restatement (anything with ``.table`` and ``.restate(results)``)
REGISTRY: dict = {}


@dataclass(frozen=True)
class Rebuild:
    """An exact table, built from no runs (an accountant, a benchmark's CSV): re-stated by building it again into
    the folder, its builder's claims under the current rule."""

    table: str

    def restate(self, results: Path) -> list[Path]:
        from dp_adam_bench.report.context import ReportContext
        from dp_adam_bench.report.registry import build, spec

        if spec(self.table).experiment is not None:
            raise ValueError(f"table {self.table!r} is built from runs: it needs a restatement from its CSV")
        return build(self.table, ReportContext(out=results))[:2]


def register(r):
    REGISTRY[r.table] = r
    return r


def read_table_csv(path: Path, text: tuple[str, ...] = ()) -> pd.DataFrame:
    """A table's CSV as its builder's frame held it: ``text`` columns as text, and a column of whole numbers with
    blanks (a nullable integer the builder wrote, e.g. the seeds of a row that has none) as integers again, not the
    floats pandas reads them as (which would print "4.000" where the builder printed "4")."""
    frame = pd.read_csv(path, dtype={c: str for c in text})
    raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    for col in frame.columns:
        if col in text or not pd.api.types.is_float_dtype(frame[col]) or not frame[col].isna().any():
            continue
        written = [v for v in raw[col] if v != ""]
        if written and all(re.fullmatch(r"-?\d+", v) for v in written):
            frame[col] = frame[col].astype("Int64")
    return frame


def restated_frame(frame: pd.DataFrame, spreads: Mapping[str, tuple[str, str]]) -> pd.DataFrame:
    """``frame`` with each old spread column renamed, in place, and a population std turned into the sample std."""
    df = frame.copy()
    for old, (new, kind) in spreads.items():
        if old not in df.columns:
            continue  # re-stated already
        if kind == "population":
            df[old] = [  # a row without seeds (a paper-only row: no n) has no spread
                None if pd.isna(n) else stats.sample_from_population_std(s, int(n))
                for s, n in zip(df[old], df["n"], strict=True)
            ]
        elif kind != "sample":
            raise ValueError(f"spread kind {kind!r} of column {old!r} is not 'population' or 'sample'")
        df = df.rename(columns={old: new})
    return df


@dataclass
class Markdown:
    """A table's md, parsed back into the parts :func:`~dp_adam_bench.report.common.write_table` wrote."""

    title: str
    command: str
    setting: str
    claims: list[str]
    sections: list[tuple[str, str]]
    figure: str | None
    notes: list[str]


def parse_markdown(text: str) -> Markdown:
    """The parts of an md that :func:`~dp_adam_bench.report.common.write_table` wrote (ValueError otherwise)."""
    lines = text.split("\n")
    if not lines[0].startswith("# ") or not lines[2].startswith("Regenerate: `"):
        raise ValueError("not a table md written by write_table: no title and Regenerate line")
    figure = next((line for line in lines if line.startswith("![")), None)
    blocks = re.split(r"\n(?=## )", "\n".join(line for line in lines if not line.startswith("![")))
    setting = next((line[len("Setting: ") :] for line in lines if line.startswith("Setting: ")), "")
    claims, sections, notes = [], [], []
    for block in blocks[1:]:
        heading, _, body = block.partition("\n\n")
        body = body.rstrip("\n")
        if heading == CLAIMS_HEADING:
            claims = [line for line in body.split("\n") if line.startswith("- ")]
        elif heading == NOTES_HEADING:
            notes = [line[2:] for line in body.split("\n") if line.startswith("- ")]
        elif heading.startswith("## Missing runs"):
            raise ValueError("the table lacks runs its preset expects: re-state a complete table only")
        else:
            sections.append((heading[3:], body))
    return Markdown(
        lines[0][2:], lines[2][len("Regenerate: `") : -1], setting, claims, sections, figure, notes
    )


#: verdicts of the rules before the five states, read back from an old md (a line carrying one is re-checked)
LEGACY_VERDICTS = ("does not hold",)
#: verdicts that an old rule wrote too, with another meaning: a line carrying one is re-checked, never kept
AMBIGUOUS_VERDICTS = ("holds",)


@dataclass(frozen=True)
class ClaimLine:
    """One claim line of an md as written: its text, its verdict and its detail."""

    text: str
    verdict: str
    detail: str

    def claim(self, exact: Mapping[str, str] | None = None) -> Claim:
        """The :class:`Claim` of a line under the current rule; an old exact one (its text starts with a key of
        ``exact``) in matches / differs with its reason; ValueError for another of an old rule."""
        why = next((w for prefix, w in (exact or {}).items() if self.text.startswith(prefix)), None)
        if why is not None and self.verdict in ("holds", "does not hold"):
            return Claim.exact(self.text, self.verdict == "holds", self.detail, why, from_runs=True)
        if self.verdict in (*LEGACY_VERDICTS, *AMBIGUOUS_VERDICTS):
            raise ValueError(
                f"claim {self.text[:80]!r} says {self.verdict!r}: re-check it under the current rule"
            )
        return Claim(self.text, self.verdict, self.detail)


def claim_of_line(line: str) -> ClaimLine:
    """The text, verdict and detail of a claim line (:meth:`Claim.line`), under the current rule or an old one."""
    verdicts = (*VERDICTS, *LEGACY_VERDICTS)
    m = re.match(r"- (.*?): \*\*(" + "|".join(map(re.escape, verdicts)) + r")\*\*(?: \((.*)\))?$", line, re.S)
    if not m or m.group(2) == INCOMPLETE:
        raise ValueError(f"not a complete claim line: {line[:80]!r}")
    return ClaimLine(m.group(1), m.group(2), m.group(3) or "")


def merged_claims(
    old_lines: list[str], new: list[Claim], exact: Mapping[str, str] | None = None
) -> list[Claim]:
    """The md's claims with each one the builder re-checks replaced in place by its new statement. A line the
    builder does not re-check is kept where it is under the current rule, or turned into matches / differs where
    it is exact (``exact``: :attr:`Restatement.exact`); another under an old rule is refused."""
    by_text = {c.text: c for c in new}
    out = []
    for parsed in map(claim_of_line, old_lines):
        out.append(by_text.pop(parsed.text) if parsed.text in by_text else parsed.claim(exact))
    if by_text:
        raise ValueError(f"re-checked claims not in the md: {sorted(by_text)}")
    return out


def restate(table: str, results: Path) -> list[Path]:
    """Re-state ``<results>/<table>.{csv,md}`` in place (see the module docstring); the paths written. A table
    whose restatement also reads its md and the tables beside it registers a
    :class:`~dp_adam_bench.report.restate_md.MdRestatement`, which re-states it its own way."""
    if table not in REGISTRY:
        load_builder(table)
    if table not in REGISTRY and table in REBUILT:
        register(Rebuild(table))
    if table not in REGISTRY:
        for other in _report_tables():  # every builder registers its restatements when imported
            load_builder(other)
        raise ValueError(f"table {table!r} has no restatement; valid: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[table].restate(results)


def committed(results: Path, table: str) -> tuple[Path, Path]:
    """``<results>/<table>.csv`` and ``.md``; FileNotFoundError naming the command that builds them."""
    paths = results / f"{table}.csv", results / f"{table}.md"
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is not there: build the table first (`make reproduce-table TABLE={table}`)"
            )
    return paths


def apply(r: Restatement, results: Path, md_text: str | None = None) -> list[Path]:
    """Re-state ``<results>/<r.table>.{csv,md}`` in place by ``r``; the paths written. ``md_text``: the md as the
    caller has already read (and reworded) it; nothing is written before the whole table is re-stated."""
    csv_path, md_path = committed(results, r.table)
    table = r.table
    frame = restated_frame(read_table_csv(csv_path, r.text), r.spreads)
    md = parse_markdown(md_path.read_text() if md_text is None else md_text)
    claims = merged_claims(md.claims, r.claims(frame), r.exact)
    line = RESTATED.format(table=table)
    said = {line, *(old.format(table=table) for old in OLD_RESTATED)}
    notes = r.notes(md.notes, claims)
    if r.frame_notes is not None:
        notes = r.frame_notes(frame, notes)
    notes = [n for n in notes if n not in said] + [line]
    figure = Path(re.match(r"!\[.*?\]\((.*)\)", md.figure).group(1)) if md.figure else None
    return write_table(
        table,
        frame,
        out=results,
        title=md.title,
        command=md.command,
        setting=md.setting,
        claims=claims,
        notes=notes,
        figure=figure,
        digits=r.digits,
        extra_sections=r.sections(frame, md.sections) if r.sections else md.sections,
    )[:2]


#: the exact tables (no runs) re-stated by building them again, each in seconds to a minute (privacy_audit, which
#: audits 175 runs in minutes, and li_ghost_clipping, a view of a benchmark that moves, are re-stated from their md
#: and CSV instead)
REBUILT = (
    "ganesh_mechanisms",
    "li_e2e_accounting",
    "li_glue_accounting",
    "li_dialog_accounting",
    "tang_budget",
    "lecture_mechanisms",
)


def _report_tables() -> tuple[str, ...]:
    from dp_adam_bench.report.registry import REPORTS

    return REPORTS.names()


def load_builder(table: str) -> None:
    """Import the module that builds ``table``: it registers its restatement."""
    from dp_adam_bench.report.registry import REPORTS

    if table in REPORTS.names():
        importlib.import_module(REPORTS.get(table).builder.split(":")[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dp_adam_bench.report.restate", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("tables", nargs="+", help="table ids (results/<id>.csv and .md)")
    ap.add_argument("--results", type=Path, default=Path("results"), help="the folder holding them")
    args = ap.parse_args(argv)
    # run as a script this file is __main__, whose REGISTRY is not the one the builders register in
    package = importlib.import_module("dp_adam_bench.report.restate")
    for t in args.tables:
        try:
            written = package.restate(t, args.results)
        except (ValueError, FileNotFoundError) as err:  # one line naming the table or file, not a traceback
            print(f"error: {err}", file=sys.stderr)
            return 2
        for path in written:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
