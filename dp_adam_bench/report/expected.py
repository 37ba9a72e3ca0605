"""The runs a preset's sweep expects for a profile, and which of them a report still lacks.

A report built while its sweep is running sees only some runs; every claim it checks is then marked incomplete
(:func:`dp_adam_bench.report.common.write_table`), and the runs it lacks are listed, each as the overrides that
make it (``optimizer=adam noise=independent optimizer.lr=0.001 seed=1``), from the preset's ``sweep`` node
(entries x grid x seeds). Runs are matched on the swept values of their config, so no config is composed: a
paper-profile grid of thousands of runs is checked in a moment.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from dp_adam_bench.report.aggregate import get, split_complete
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.sweep import SweepSpec, sweep_spec
from dp_adam_bench.tracking.run_store import RunRecord

#: a config group chosen in an override (``optimizer=adam``) is recorded in the run config under this field
GROUP_FIELDS = {"optimizer": "optimizer.name", "noise": "noise.kind", "task": "task.name"}


def canonical(x):
    """Values equal up to float formatting compare equal (``1e-4`` from YAML vs ``0.0001`` from a config)."""
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, (int, float)):
        return float(f"{float(x):.12g}") if math.isfinite(float(x)) else str(x)
    return str(x)


def point_text(point: dict) -> str:
    return " ".join(f"{k}={'null' if v is None else v}" for k, v in point.items())


def missing_runs(spec: SweepSpec, complete: list[RunRecord]) -> list[dict]:
    """The sweep points of ``spec`` (``{override key: value}``) that no complete run matches, in launch order."""
    seen: dict[tuple, set] = defaultdict(set)  # key tuple -> canonical value tuples of the complete runs
    missing = []
    for point in spec.points():
        keys = tuple(point)
        if keys not in seen:
            seen[keys] = {
                tuple(canonical(get(r.config, GROUP_FIELDS.get(k, k))) for k in keys) for r in complete
            }
        if tuple(canonical(v) for v in point.values()) not in seen[keys]:
            missing.append(point)
    return missing


@dataclass
class PresetRuns:
    """The runs of one preset for a report: all of them, split complete / incomplete, and the expected ones
    that are not complete yet."""

    spec: SweepSpec
    complete: list[RunRecord]
    incomplete: list[RunRecord]
    missing_points: list[dict]

    @property
    def missing(self) -> list[str]:
        """Every expected run not complete, as the overrides that make it."""
        return [point_text(p) for p in self.missing_points]

    def lacking(self, **fixed) -> list[str]:
        """The missing runs a table reads when it reads only those with these swept values
        (``lacking(optimizer="adam")``)."""
        return [
            point_text(p)
            for p in self.missing_points
            if all(canonical(p.get(k)) == canonical(v) for k, v in fixed.items())
        ]


def preset_runs(ctx: ReportContext, preset: str) -> PresetRuns:
    """Read the runs of ``preset`` (for ``ctx.profile``) from ``ctx``'s source and compare them with its sweep."""
    spec = sweep_spec(preset, ctx.profile)
    complete, incomplete = split_complete(ctx.load_runs(spec.name))
    return PresetRuns(spec, complete, incomplete, missing_runs(spec, complete))
