"""The pilots (or tuning runs) behind a CPU table: every run, the setting each group chose, and whether the grid
brackets it.

A CPU profile that cannot afford a paper's full tuning grid in every cell fixes one value per optimizer family from
pilots (a sweep preset of its own, ``configs/experiment/<table>_pilots.yaml``, scored on a split the table does not
report). This report keeps those pilots as evidence: the mean metric of every tried value per group (the preset's
``sweep.selection.per``), the chosen one (the selection rule of :mod:`dp_adam_bench.report.aggregate`: best mean
over seeds), and, per group, a check that the chosen value is not at an edge of its grid (a value at the edge
says the grid should be extended before the choice is trusted). With several tuned knobs
(``ganesh_fig3_tuning``: eta, eps_s, eps_s1, momentum) each knob's grid is the slice through the chosen setting,
the other knobs held at their chosen values. Diverged runs (a NaN or infinite metric) are
listed, never chosen.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from dp_adam_bench.report.aggregate import group_values, select_best
from dp_adam_bench.report.common import Claim, incomplete_note, write_table
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.expected import preset_runs


def _order(v):
    return (v is None, v if isinstance(v, (int, float)) else str(v))


def _group_label(per: list[str], key: tuple) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(per, key, strict=True))


def build(ctx: ReportContext | None, preset: str, table: str | tuple[str, ...], scored_on: str) -> list[Path]:
    """Write ``results/<preset>.{csv,md}`` from the runs of the pilot preset ``preset``, whose choices the table(s)
    ``table`` use; ``scored_on`` says what the metric was measured on (printed in the setting)."""
    ctx = ctx or ReportContext()
    tables = (table,) if isinstance(table, str) else tuple(table)
    named = " and ".join(f"`{t}`" for t in tables)
    command = f"make reproduce-table TABLE={preset} PROFILE={ctx.profile}"
    runs = preset_runs(ctx, preset)
    if not runs.complete:
        raise FileNotFoundError(f"no complete runs in {ctx.where(runs.spec.name)}; run `{command}`")
    sel = runs.spec.selection
    per, tuned = list(sel.per), list(sel.tuned)
    groups = group_values(runs.complete, per=per, tuned=tuned, metric=sel.metric)
    # the choice is the preset's selection rule itself, so a table that used select_best would pick the same
    chosen_by = select_best(runs.complete, per=per, tuned=tuned, metric=sel.metric, mode=sel.mode)

    rows, claims, unchecked = [], [], []
    for key in sorted(groups, key=lambda k: tuple(str(v) for v in k)):
        cell = chosen_by.get(key)
        # None: every value diverged
        best = tuple(cell.chosen[k] for k in tuned) if cell is not None else None
        # the knobs this group sets (IME has no momentum, sgd no eps_s: those stay None and are not printed)
        knobs = [i for i in range(len(tuned)) if any(setting[i] is not None for setting in groups[key])]
        for setting in sorted(groups[key], key=lambda st: tuple(_order(v) for v in st)):
            vals = groups[key][setting]
            rows.append(
                {
                    **{k.split(".")[-1]: v for k, v in zip(per, key, strict=True)},
                    **{tuned[i].split(".")[-1]: setting[i] for i in knobs},
                    sel.metric: float(np.mean(vals)) if all(math.isfinite(x) for x in vals) else float("nan"),
                    "n": len(vals),
                    "chosen": "yes" if setting == best else "",
                }
            )
        if best is None:
            continue
        # each knob's grid through the chosen setting (the other knobs at their chosen values)
        for i in knobs:
            grid = sorted(
                st[i] for st in groups[key] if all(st[j] == best[j] for j in range(len(tuned)) if j != i)
            )
            tried = sorted({st[i] for st in groups[key] if st[i] is not None})
            if len(grid) == 1 and len(tried) > 1:  # a coordinate-wise grid: the slice misses the others
                unchecked.append(
                    f"{_group_label(per, key)}: {tuned[i]} = {best[i]:g} (tried {', '.join(f'{v:g}' for v in tried)} "
                    "at other settings of the other knobs)"
                )
            if len(grid) > 1:
                claims.append(
                    Claim(
                        f"[pilot] {_group_label(per, key)}: the chosen {tuned[i]} is inside its grid",
                        grid[0] < best[i] < grid[-1],
                        f"{tuned[i]} = {best[i]:g} of {', '.join(f'{v:g}' for v in grid)}",
                    )
                )
    names = [k.split(".")[-1] for k in per] + [k.split(".")[-1] for k in tuned]
    columns = [c for c in names if any(c in r for r in rows)] + [sel.metric, "n", "chosen"]
    # the knobs in the preset's order, whichever group sets them first
    df = pd.DataFrame(rows, columns=columns)
    n_seeds = sorted({len(v) for g in groups.values() for v in g.values()})
    notes = [
        "The choice of a learning rate from runs on the private training data is not accounted in any epsilon "
        "here, as in the papers' own tuning; the pilots score on a split the table does not "
        "report, so at least the table's numbers are not selected on themselves.",
        *incomplete_note(runs.incomplete),
    ]
    if unchecked:
        notes.append(
            "Not checked against an edge (the chosen value is the only one run at the chosen setting of the other "
            "knobs, so no slice through it brackets it): " + "; ".join(unchecked) + "."
        )
    setting = (
        f"the pilots of {named} (preset `{preset}`, profile {ctx.profile}): {sel.metric} {scored_on}, "
        f"{'/'.join(map(str, n_seeds))} seed(s) per value; chosen = the best mean ({sel.mode}) per "
        f"{', '.join(per)}. {named} use{'s' if len(tables) == 1 else ''} the chosen values (each preset says so "
        "and where they apply)."
    )
    return write_table(
        preset,
        df,
        out=ctx.out,
        title=f"{'Learning-rate pilots' if len(tuned) == 1 else 'Tuning runs'} of {' and '.join(tables)}",
        command=command,
        setting=setting,
        claims=claims,
        notes=notes,
        digits=4,
        missing=runs.missing,
    )
