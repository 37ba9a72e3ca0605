"""Re-state a committed table whose restatement needs more than its CSV (:mod:`dp_adam_bench.report.restate`):
cells its md prints in a section only (the horizon study's held-out seeds), the table beside it in the same folder
(ganesh_fig3's reading of the horizon study's gaps), and claim lines the builder now words otherwise (a statement
that named the old rule's verdict). restate.py's hooks read the CSV frame only; this module binds the md and the
folder to the builder's hooks and applies them. :func:`~dp_adam_bench.report.restate.restate` (and its command)
calls it for the tables registered here; re-stating twice changes nothing.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from dp_adam_bench.report import restate
from dp_adam_bench.report.common import Claim

Sections = list[tuple[str, str]]


@dataclass(frozen=True)
class MdRestatement:
    """A :class:`~dp_adam_bench.report.restate.Restatement` whose ``claims`` and ``sections`` also read the md
    (:class:`~dp_adam_bench.report.restate.Markdown`) and the folder, and whose ``retext`` gives the builder's
    wording of an old claim's text (the text itself where it is unchanged)."""

    table: str
    spreads: Mapping[str, tuple[str, str]]
    claims: Callable[[pd.DataFrame, restate.Markdown, Path], list[Claim]]
    notes: Callable[[list[str], list[Claim], restate.Markdown], list[str]]
    sections: Callable[[pd.DataFrame, restate.Markdown, Path], Sections]
    retext: Callable[[str], str] = str
    exact: Mapping[str, str] = field(default_factory=dict)  # restate.Restatement.exact
    digits: int = 4
    text: tuple[str, ...] = ()  # columns read back as text (restate.Restatement.text)

    def restate(self, results: Path) -> list[Path]:
        return restate_md(self, results)


def register(r: MdRestatement) -> MdRestatement:
    """``r`` in :data:`restate.REGISTRY`: ``restate.restate(r.table, ...)`` re-states it by :func:`restate_md`."""
    return restate.register(r)


def restate_md(r: MdRestatement, results: Path) -> list[Path]:
    """Re-state ``<results>/<r.table>.{csv,md}`` in place by :func:`restate.apply`, ``r``'s hooks bound to the md
    and the folder, its claim lines first given the builder's wording."""
    _, path = restate.committed(results, r.table)
    text = path.read_text()
    md = restate.parse_markdown(text)
    bound = restate.Restatement(
        r.table,
        r.spreads,
        claims=lambda frame: r.claims(frame, md, results),
        notes=lambda old, claims: r.notes(old, claims, md),
        digits=r.digits,
        text=r.text,
        sections=lambda frame, _: r.sections(frame, md, results),
        exact=r.exact,
    )
    return restate.apply(bound, results, md_text=retexted(text, md.claims, r.retext))


def retexted(text: str, claim_lines: list[str], retext: Callable[[str], str]) -> str:
    """``text`` (an md) with each claim line's text in the builder's wording (``retext``)."""
    for line in claim_lines:
        old = restate.claim_of_line(line).text
        new = retext(old)
        if new != old:
            text = text.replace(line, f"- {new}{line[len(old) + 2 :]}", 1)
    return text


def read_markdown_table(text: str) -> pd.DataFrame:
    """The first markdown table in ``text`` as :func:`~dp_adam_bench.report.common.markdown_table` printed it
    (numbers as they were printed; empty cells missing)."""
    lines = [line for line in text.split("\n\n")[0].split("\n") if line.startswith("|")]
    if len(lines) < 2:
        raise ValueError(f"no markdown table in {text[:80]!r}")
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in [lines[0], *lines[2:]]
    ]
    csv = "\n".join(",".join(f'"{c}"' for c in row) for row in rows)
    return pd.read_csv(io.StringIO(csv))


def replaced(sections: Sections, by: Mapping[str, Callable[[str, str], tuple[str, str]]]) -> Sections:
    """``sections`` with each one whose heading starts with a key of ``by`` replaced by what ``by[key](heading,
    body)`` gives (a heading and a body); the others kept as they are."""
    out = []
    for heading, body in sections:
        key = next((k for k in by if heading.startswith(k)), None)
        out.append((heading, body) if key is None else by[key](heading, body))
    return out


def section(md: restate.Markdown, heading_start: str) -> tuple[str, str] | None:
    """The md's section whose heading starts with ``heading_start``; None where it has none."""
    return next(((h, body) for h, body in md.sections if h.startswith(heading_start)), None)
