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
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dp_adam_bench.report import stats
from dp_adam_bench.report.common import VERDICTS, Claim, write_table

CLAIMS_HEADING = "## Paper claims checked here"
NOTES_HEADING = "## Notes"
RESTATED = (
    "Re-stated from this table's CSV under the shared rule (dp_adam_bench/report/stats.py: Welch's t, sample "
    "std), its runs not re-run: `python -m dp_adam_bench.report.restate {table}`. The numbers are the runs'; the "
    "claim lines and the notes that word the rule are new."
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

    def restate(self, results: Path) -> list[Path]:
        return apply(self, results)


#: table id -> its restatement (anything with ``.table`` and ``.restate(results)``)
REGISTRY: dict = {}


def register(r):
    REGISTRY[r.table] = r
    return r


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


def claim_of_line(line: str) -> Claim:
    """The :class:`Claim` whose :meth:`~Claim.line` is ``line``."""
    m = re.match(r"- (.*?): \*\*(" + "|".join(map(re.escape, VERDICTS)) + r")\*\*(?: \((.*)\))?$", line, re.S)
    if not m or m.group(2) == "incomplete":
        raise ValueError(f"not a complete claim line: {line[:80]!r}")
    holds = {"holds": True, "does not hold": False, "not checked": None}[m.group(2)]
    return Claim(m.group(1), holds, m.group(3) or "")


def merged_claims(old_lines: list[str], new: list[Claim]) -> list[Claim]:
    """The md's claims with each one the builder re-checks replaced in place by its new statement."""
    by_text = {c.text: c for c in new}
    out = [by_text.pop(c.text, c) for c in map(claim_of_line, old_lines)]
    if by_text:
        raise ValueError(f"re-checked claims not in the md: {sorted(by_text)}")
    return out


def restate(table: str, results: Path) -> list[Path]:
    """Re-state ``<results>/<table>.{csv,md}`` in place (see the module docstring); the paths written. A table
    whose restatement also reads its md and the tables beside it registers a
    :class:`~dp_adam_bench.report.restate_md.MdRestatement`, which re-states it its own way."""
    if table not in REGISTRY:
        load_builder(table)
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
    frame = restated_frame(pd.read_csv(csv_path, dtype={c: str for c in r.text}), r.spreads)
    md = parse_markdown(md_path.read_text() if md_text is None else md_text)
    claims = merged_claims(md.claims, r.claims(frame))
    line = RESTATED.format(table=table)
    notes = [n for n in r.notes(md.notes, claims) if n != line] + [line]
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
