"""The rows of a paper's table that a profile does not run (another dataset, another model size), printed with the
paper's numbers and the reason each is not run here, so that a table never drops part of the paper silently.

A table builds one :class:`NotRun` per (paper row, privacy column) from its ``configs/paper/*.yaml`` block and
passes :func:`section` to :class:`dp_adam_bench.report.skeleton.Table` as an extra section. :func:`larger_is_better`
reads a "larger models do better" claim off the paper's own numbers, for the tables whose profiles run one model
size only (that claim is then the paper's, stated as such, not ours).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

NOT_RUN_TITLE = "The paper's other rows (not run here)"


@dataclass(frozen=True)
class NotRun:
    """One row of the paper's table at one privacy column: its numbers by header, and why it is not run here."""

    row: str
    column: str
    values: Mapping[str, str]
    why: str


def fmt(value) -> str:
    """A paper number as printed (a list, e.g. MNLI's matched / mismatched, joined with ' / '); '' for none."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return " / ".join(fmt(v) for v in value)
    return f"{float(value):g}"


def section(rows: Sequence[NotRun], headers: Sequence[str]) -> str:
    """A markdown table of ``rows``: the paper's row, column, a value per header, and the reason."""
    lines = [
        "The paper prints these; no run of this profile produces them. Each says why and what would run it.",
        "",
        "| paper row | column | " + " | ".join(headers) + " | not run here |",
        "|---|---|" + "---|" * len(headers) + "---|",
    ]
    for r in rows:
        cells = " | ".join(r.values.get(h, "") for h in headers)
        lines.append(f"| {r.row} | {r.column} | {cells} | {r.why} |")
    return "\n".join(lines)


def larger_is_better(
    pairs: Sequence[tuple[str, str]], table: Mapping[str, Mapping], keys: Sequence[str], lower_is_better=()
) -> tuple[int, int, list[str]]:
    """How many of the paper's cells put the larger model ahead: for each (smaller, larger) row pair and each key
    (a task, or a metric; ``lower_is_better``: the keys where less is better), across every column of ``table``
    (column -> row -> key -> value, a list compared element-wise). Returns (ahead, compared, the cells that are
    not)."""
    ahead, compared, against = 0, 0, []
    for col, rows in table.items():
        for small, large in pairs:
            if small not in rows or large not in rows:
                continue
            for key in keys:
                a, b = rows[small].get(key), rows[large].get(key)
                if a is None or b is None:
                    continue
                for i, (x, y) in enumerate(zip(_as_list(a), _as_list(b), strict=True)):
                    compared += 1
                    better = y < x if key in lower_is_better else y > x
                    if better:
                        ahead += 1
                    else:
                        part = f"[{i}]" if isinstance(a, (list, tuple)) else ""
                        against.append(f"{col} {key}{part}: {large} {y:g} vs {small} {x:g}")
    return ahead, compared, against


def _as_list(v) -> list[float]:
    return [float(x) for x in v] if isinstance(v, (list, tuple)) else [float(v)]
