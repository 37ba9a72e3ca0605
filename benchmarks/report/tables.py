"""Reading the benchmark CSVs and writing them as markdown: cells, tables and the 'met' / 'missed by' verdicts."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

#: columns that identify a row: shown even when every row has the same value
KEY_COLUMNS = {"model", "batch_size", "mode", "precision", "engine", "mechanism", "setting", "accountant"}


def read_csv(path: Path) -> pd.DataFrame | None:
    """The CSV, or None when it is missing or unreadable (the README then says 'not measured yet')."""
    if not path.is_file():
        return None
    try:
        return pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError):
        return None


def rows(df: pd.DataFrame | None, **eq) -> pd.DataFrame:
    """The rows of ``df`` whose columns equal ``eq`` (an empty frame for a missing CSV)."""
    if df is None:
        return pd.DataFrame()
    m = pd.Series(True, index=df.index)
    for k, v in eq.items():
        m &= df[k] == v
    return df[m]


def fmt(x) -> str:
    """One table cell: empty for a missing value, integers without '.0', 4 significant digits otherwise."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x == int(x) and abs(x) < 1e15:
            return str(int(x))
        if abs(x) >= 1000:
            return f"{x:.0f}"
        return f"{x:.4g}"
    return str(x).replace("|", "\\|")


def _present(v) -> bool:
    return not (v is None or (isinstance(v, float) and math.isnan(v)) or v == "")


def markdown_table(df: pd.DataFrame) -> tuple[str, str]:
    """(caption of the columns that are the same in every row, markdown table of the others)."""
    df = df.astype(object).where(df.notna(), None)
    cols = [c for c in df.columns if any(_present(v) for v in df[c])]  # drop all-empty columns
    constant = {}
    if len(df) > 1:
        for c in cols:
            if c in KEY_COLUMNS:
                continue
            vals = {fmt(v) for v in df[c]}
            if len(vals) == 1:
                constant[c] = vals.pop()
    shown = [c for c in cols if c not in constant]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(fmt(r[c]) for c in shown) + " |")
    caption = "; ".join(f"{c} = {v}" for c, v in constant.items())
    return (f"Same in every row: {caption}." if caption else ""), "\n".join(lines)


# ----------------------------------------------------------------------------------------------- verdicts


def num(v: float, unit: str) -> str:
    if unit == "x":
        return f"{v:.2f}x"
    if unit == "%":
        return f"{100 * v:.1f} %"
    if unit == "s":
        return f"{v:.4g} s"
    return f"{v:.3g}{unit}"


def verdict(value: float, limit: float, unit: str = "x", strict: bool = False) -> str:
    """'met' / 'missed by ...' for value <= limit (value < limit with strict)."""
    if value != value:
        return "not measured yet"
    ok = value < limit if strict else value <= limit
    if ok:
        return f"met ({num(value, unit)} {'<' if strict else '<='} {num(limit, unit)})"
    over = value - limit
    pct = 100 * over / limit
    pct_s = f"{pct:.1f}" if pct < 10 else f"{pct:.0f}"
    return f"missed by {num(over, unit)} ({num(value, unit)} vs {num(limit, unit)}, {pct_s} % over)"


def range_verdict(value: float, low: float | None, high: float, unit: str = "x") -> str:
    """Against a measured range (low, high) to beat: 'met' only below its best (lowest) number."""
    if value != value:
        return "not measured yet"
    if low is None:
        return verdict(value, high, unit)
    if value < low:
        return f"met: beats the best PITFALLS number ({num(low, unit)}) by {num(low - value, unit)}"
    where = (
        "within the PITFALLS range, not beaten" if value <= high else "worse than the whole PITFALLS range"
    )
    return f"missed by {num(value - low, unit)} ({where})"


def factor_verdict(value: float, limit: float) -> str:
    """'met (1.22x <= 1.50x)' or 'MISSED x1.41 (2.12x vs 1.50x)': the miss factor is measured / target."""
    if value != value:
        return "not measured"
    if value <= limit:
        return f"met ({value:.2f}x <= {limit:.2f}x)"
    return f"MISSED x{value / limit:.2f} ({value:.2f}x vs {limit:.2f}x)"


def ratio_cell(r: pd.Series | None, step_col: str) -> str:
    """'1.22x / 1.05x' (time / memory against non-private), with the micro-batches where there were several;
    'failed' where the step has no time (``step_col``), 'no baseline' where the ratio is missing."""
    if r is None:
        return ""
    if r.ratio_to_nonprivate != r.ratio_to_nonprivate:
        return "failed" if r[step_col] != r[step_col] else "no baseline"
    micro = ""
    if r.physical_batch_size == r.physical_batch_size and r.physical_batch_size < r.batch_size:
        micro = f" ({-(-int(r.batch_size) // int(r.physical_batch_size))} micro-batches)"
    return f"{r.ratio_to_nonprivate:.2f}x / {r.ratio_mem_to_nonprivate:.2f}x{micro}"


def quick_prefix(row: pd.Series) -> str:
    """A warning prefix for the verdicts of rows from --quick runs (fewer than 5 timed steps)."""
    steps = row.get("steps")
    return "QUICK RUN, not representative: " if steps is not None and steps == steps and steps < 5 else ""
