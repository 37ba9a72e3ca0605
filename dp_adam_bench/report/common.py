"""Shared report plumbing: paper numbers, claim checks, and writing ``results/<id>.{csv,md}``.

Paper numbers are read from ``configs/paper/*.yaml`` and printed beside ours; they never feed back into
training or selection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from dp_adam_bench.paths import PAPER_DIR, results_dir


def load_paper(name: str) -> dict:
    """Published numbers of one paper (``configs/paper/<name>.yaml``)."""
    path = PAPER_DIR / f"{name}.yaml"
    if not path.exists():
        valid = sorted(p.stem for p in PAPER_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no paper file {path}; valid names: {valid}")
    with open(path) as fh:
        return yaml.safe_load(fh)


@dataclass(frozen=True)
class Claim:
    """A paper claim stated as a checkable inequality, with whether it holds in our numbers."""

    text: str
    holds: bool | None
    detail: str = ""

    def line(self) -> str:
        verdict = {True: "**holds**", False: "**does not hold**", None: "**not checked**"}[self.holds]
        return f"- {self.text}: {verdict}" + (f" ({self.detail})" if self.detail else "")


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


def markdown_table(df: pd.DataFrame, digits: int = 4) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(fmt(row[c], digits) for c in cols) + " |")
    return "\n".join(lines)


def write_table(
    table_id: str,
    df: pd.DataFrame,
    *,
    title: str,
    command: str,
    setting: str = "",
    claims: Sequence[Claim] = (),
    notes: Sequence[str] = (),
    figure: Path | None = None,
    digits: int = 4,
    extra_sections: Sequence[tuple[str, str]] = (),
) -> list[Path]:
    """Write ``results/<table_id>.csv`` and ``results/<table_id>.md``; return the paths written.

    The markdown opens with the command that regenerates it, then the setting, the table (paper beside ours),
    the claim checks and the notes.
    """
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / f"{table_id}.csv"
    md_path = out / f"{table_id}.md"
    df.to_csv(csv_path, index=False)
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


def save_figure(fig, table_id: str) -> Path:
    """Write ``results/<table_id>.png`` and close the figure."""
    import matplotlib.pyplot as plt

    path = results_dir() / f"{table_id}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def incomplete_note(incomplete) -> list[str]:
    """The note listing runs left out because they have no complete summary (none: no note)."""
    return ["Incomplete runs left out: " + ", ".join(r.path.name for r in incomplete)] if incomplete else []
