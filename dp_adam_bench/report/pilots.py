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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from dp_adam_bench.report.aggregate import get, group_values, select_best
from dp_adam_bench.report.common import Claim, incomplete_note, write_table
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.expected import preset_runs
from dp_adam_bench.report.restate import Restatement, register
from dp_adam_bench.report.skeleton import GRID_EXACT

if TYPE_CHECKING:
    from dp_adam_bench.sweep import Selection


#: the opening of a pilot table's claim lines
PILOT = "[pilot]"


def _order(v):
    return (v is None, v if isinstance(v, (int, float)) else str(v))


def _group_label(per: list[str], key: tuple) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(per, key, strict=True))


@dataclass(frozen=True)
class PilotGroup:
    """One group of the preset's ``sweep.selection.per`` (e.g. optimizer=adam, noise=none): the metric values of
    every tried setting of the tuned knobs, and the chosen setting (None: every value diverged)."""

    per: list[str]
    tuned: list[str]
    key: tuple
    tried: dict  # setting (a tuple over ``tuned``) -> the metric of each seed
    best: tuple | None

    @property
    def knobs(self) -> list[int]:
        """The knobs this group sets (IME has no momentum, sgd no eps_s: those stay None and are not printed)."""
        return [i for i in range(len(self.tuned)) if any(setting[i] is not None for setting in self.tried)]

    def rows(self, metric: str) -> list[dict]:
        """One table row per tried setting: its mean metric (NaN if a seed diverged), seeds, and if chosen."""
        rows = []
        for setting in sorted(self.tried, key=lambda st: tuple(_order(v) for v in st)):
            vals = self.tried[setting]
            rows.append(
                {
                    **{k.split(".")[-1]: v for k, v in zip(self.per, self.key, strict=True)},
                    **{self.tuned[i].split(".")[-1]: setting[i] for i in self.knobs},
                    metric: float(np.mean(vals)) if all(math.isfinite(x) for x in vals) else float("nan"),
                    "n": len(vals),
                    "chosen": "yes" if setting == self.best else "",
                }
            )
        return rows

    def edge_checks(self) -> tuple[list[Claim], list[str]]:
        """A claim per knob that the chosen value is inside its grid, the slice through the chosen setting (the
        other knobs at their chosen values); and the knobs whose slice has the chosen value alone (not checked)."""
        claims, unchecked = [], []
        if self.best is None:
            return claims, unchecked
        best, tuned, label = self.best, self.tuned, _group_label(self.per, self.key)
        for i in self.knobs:
            grid = sorted(
                st[i] for st in self.tried if all(st[j] == best[j] for j in range(len(tuned)) if j != i)
            )
            tried = sorted({st[i] for st in self.tried if st[i] is not None})
            if len(grid) == 1 and len(tried) > 1:  # a coordinate-wise grid: the slice misses the others
                unchecked.append(
                    f"{label}: {tuned[i]} = {best[i]:g} (tried {', '.join(f'{v:g}' for v in tried)} "
                    "at other settings of the other knobs)"
                )
            if len(grid) > 1:
                claims.append(
                    Claim.exact(
                        f"{PILOT} {label}: the chosen {tuned[i]} is inside its grid",
                        grid[0] < best[i] < grid[-1],
                        f"{tuned[i]} = {best[i]:g} of {', '.join(f'{v:g}' for v in grid)}",
                        GRID_EXACT,
                        from_runs=True,
                    )
                )
        return claims, unchecked


def pilot_groups(complete, selection: Selection) -> list[PilotGroup]:
    """The groups of the runs ``complete``, in order, each with its chosen setting. The choice is the preset's
    selection rule itself, so a table that used select_best would pick the same."""
    per, tuned = list(selection.per), list(selection.tuned)
    groups = group_values(complete, per=per, tuned=tuned, metric=selection.metric)
    chosen_by = select_best(complete, per=per, tuned=tuned, metric=selection.metric, mode=selection.mode)
    out = []
    for key in sorted(groups, key=lambda k: tuple(str(v) for v in k)):
        cell = chosen_by.get(key)
        best = tuple(cell.chosen[k] for k in tuned) if cell is not None else None
        out.append(PilotGroup(per, tuned, key, groups[key], best))
    return out


def _frame(groups: list[PilotGroup], selection: Selection) -> pd.DataFrame:
    rows = [row for g in groups for row in g.rows(selection.metric)]
    names = [k.split(".")[-1] for k in selection.per] + [k.split(".")[-1] for k in selection.tuned]
    # the knobs in the preset's order, whichever group sets them first
    columns = [c for c in names if any(c in r for r in rows)] + [selection.metric, "n", "chosen"]
    return pd.DataFrame(rows, columns=columns)


def _notes(complete, incomplete, unchecked: list[str]) -> list[str]:
    public = all(get(r.config, "task.tune") and get(r.config, "task.public_split") for r in complete)
    privacy = (
        "The pilots train and score on a public tuning split (task.public_split, task.tune) that every run of the "
        "table leaves out of its private training set: the choice reads no private example and costs no privacy "
        "(the epsilon these runs log is meaningless, as their data is public). That assumes the split may be public: "
        "on data private throughout, hold out only data you may publish, since the epsilon covers the training set "
        "alone."
        if public
        else "The choice of a learning rate from runs on the private training data is not accounted in any epsilon "
        "here, as in the papers' own tuning; the pilots score on a split the table does not "
        "report, so at least the table's numbers are not selected on themselves."
    )
    notes = [privacy, *incomplete_note(incomplete)]
    if unchecked:
        notes.append(
            "Not checked against an edge (the chosen value is the only one run at the chosen setting of the other "
            "knobs, so no slice through it brackets it): " + "; ".join(unchecked) + "."
        )
    return notes


def _setting_text(
    groups: list[PilotGroup], selection, preset: str, tables: tuple, profile: str, scored_on: str
):
    named = " and ".join(f"`{t}`" for t in tables)
    n_seeds = sorted({len(v) for g in groups for v in g.tried.values()})
    return (
        f"the pilots of {named} (preset `{preset}`, profile {profile}): {selection.metric} {scored_on}, "
        f"{'/'.join(map(str, n_seeds))} seed(s) per value; chosen = the best mean ({selection.mode}) per "
        f"{', '.join(selection.per)}. {named} use{'s' if len(tables) == 1 else ''} the chosen values (each preset "
        "says so and where they apply)."
    )


def build(ctx: ReportContext | None, preset: str, table: str | tuple[str, ...], scored_on: str) -> list[Path]:
    """Write ``results/<preset>.{csv,md}`` from the runs of the pilot preset ``preset``, whose choices the table(s)
    ``table`` use; ``scored_on`` says what the metric was measured on (printed in the setting)."""
    ctx = ctx or ReportContext()
    tables = (table,) if isinstance(table, str) else tuple(table)
    command = f"make reproduce-table TABLE={preset} PROFILE={ctx.profile}"
    runs = preset_runs(ctx, preset)
    if not runs.complete:
        raise FileNotFoundError(f"no complete runs in {ctx.where(runs.spec.name)}; run `{command}`")
    sel = runs.spec.selection
    groups = pilot_groups(runs.complete, sel)
    checks = [g.edge_checks() for g in groups]
    return write_table(
        preset,
        _frame(groups, sel),
        out=ctx.out,
        title=f"{'Learning-rate pilots' if len(sel.tuned) == 1 else 'Tuning runs'} of {' and '.join(tables)}",
        command=command,
        setting=_setting_text(groups, sel, preset, tables, ctx.profile, scored_on),
        claims=[claim for claims, _ in checks for claim in claims],
        notes=_notes(runs.complete, runs.incomplete, [u for _, unchecked in checks for u in unchecked]),
        digits=4,
        missing=runs.missing,
    )


def _restatement(table: str) -> Restatement:
    """A pilot table re-stated from its md: its only claims are the grid checks, exact (:data:`GRID_EXACT`)."""
    return Restatement(
        table, {}, claims=lambda frame: [], notes=lambda old, claims: old, exact={PILOT: GRID_EXACT}
    )


def _register_pilot_tables() -> None:
    from dp_adam_bench.report.registry import REPORTS

    for name in REPORTS.names():
        if REPORTS.get(name).builder.endswith("pilots:build"):
            register(_restatement(name))


_register_pilot_tables()
