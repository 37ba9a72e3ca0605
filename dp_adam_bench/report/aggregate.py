"""Aggregating run folders into table cells: tuning-grid selection and spread over trials/seeds.

Selection rule (what the papers do when they "tune eta"; each preset states its own under ``sweep.selection``):
within each group of runs that differ only in the tuned hyper-parameters, keep the setting with the best mean final
metric and report that setting's mean and sample std (:data:`~dp_adam_bench.report.stats.STD_CONVENTION`).
Incomplete runs are never aggregated; they are returned so the report can list them.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from dp_adam_bench.report.stats import sample_std
from dp_adam_bench.tracking.run_store import RunRecord


def get(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


GROUP_KEYS = {"optimizer": "optimizer.name", "noise": "noise.kind"}


def key_config(per: list[str], key: tuple) -> dict:
    """The nested config a group key of :func:`select_best` stands for: ``key_config(["optimizer",
    "privacy.sigma"], ("adam", 0.1)) == {"optimizer": {"name": "adam"}, "privacy": {"sigma": 0.1}}``."""
    cfg: dict = {}
    for short, value in zip(per, key, strict=True):
        *parents, leaf = GROUP_KEYS.get(short, short).split(".")
        node = cfg
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return cfg


@dataclass
class Cell:
    """One selected table cell: the mean of its ``n`` values and their sample std (None for fewer than 2)."""

    key: tuple
    mean: float
    std: float | None
    n: int
    chosen: dict
    values: list[float] = field(default_factory=list)
    candidates: list[tuple[dict, float]] = field(
        default_factory=list
    )  # (tuned hparams, mean) for every setting


def split_complete(records: list[RunRecord]) -> tuple[list[RunRecord], list[RunRecord]]:
    return [r for r in records if r.complete], [r for r in records if not r.complete]


def group_values(
    records: list[RunRecord], *, per: list[str], tuned: list[str], metric: str
) -> dict[tuple, dict[tuple, list[float]]]:
    """{group key (values of ``per``): {setting (values of ``tuned``): per-trial values of ``metric``}} over the
    complete runs (a run's ``summary.trials`` when it has them, else its final metric; NaN kept as it came)."""
    per_keys = [GROUP_KEYS.get(k, k) for k in per]
    groups: dict[tuple, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if not r.complete:
            continue
        key = tuple(get(r.config, k) for k in per_keys)
        setting = tuple(get(r.config, k) for k in tuned)
        trials = (r.summary.get("trials") or {}).get(metric)
        values = trials if trials is not None else [r.summary["metrics"][metric]]
        groups[key][setting].extend(float(v) for v in values)
    return groups


def select_best(
    records: list[RunRecord],
    *,
    per: list[str],
    tuned: list[str],
    metric: str,
    mode: str = "min",
) -> dict[tuple, Cell]:
    """Group complete runs by ``per`` (short names or dotted config keys), pick the ``tuned`` setting with the best
    mean ``metric``; the values averaged are the per-trial values of all runs (seeds) sharing that setting."""
    if mode not in ("min", "max"):
        raise ValueError(f"selection mode must be 'min' or 'max', got {mode!r}")
    cells = {}
    for key, settings in group_values(records, per=per, tuned=tuned, metric=metric).items():
        scored = [(s, float(np.mean(v))) for s, v in settings.items() if np.all(np.isfinite(v))]
        if not scored:
            continue
        best, _ = (min if mode == "min" else max)(scored, key=lambda sv: sv[1])
        vals = settings[best]
        cells[key] = Cell(
            key=key,
            mean=float(np.mean(vals)),
            std=sample_std(vals),
            n=len(vals),
            chosen=dict(zip(tuned, best, strict=True)),
            values=vals,
            candidates=sorted(
                ((dict(zip(tuned, s, strict=True)), m) for s, m in scored), key=lambda c: tuple(c[0].values())
            ),
        )
    return cells


def select_cells(records: list[RunRecord], selection, locate) -> dict[tuple[str, str], Cell]:
    """The selection rule of a preset (``selection``: per, tuned, metric, mode) applied to ``records``, each group's
    cell placed at ``locate(config of the group) -> (row, column)`` (None: not in the table). Two groups in one
    place are a bug in the preset or in ``locate``: ValueError. Runs of the selection's held-out seeds take no part
    (:func:`tuning_runs`)."""
    cells = select_best(
        tuning_runs(records, selection),
        per=list(selection.per),
        tuned=list(selection.tuned),
        metric=selection.metric,
        mode=selection.mode,
    )
    out: dict[tuple[str, str], Cell] = {}
    for key, cell in cells.items():
        place = locate(key_config(list(selection.per), key))
        if place is None or None in place:
            continue
        if place in out:
            raise ValueError(f"two selection groups fall in cell {place}: {out[place].key} and {key}")
        out[place] = cell
    return out


def tuning_runs(records: list[RunRecord], selection) -> list[RunRecord]:
    """The runs a selection may choose from: all but those of its ``heldout_seeds``."""
    held = set(getattr(selection, "heldout_seeds", ()) or ())
    return [r for r in records if get(r.config, "seed") not in held] if held else list(records)


def chosen_runs(records: list[RunRecord], cell: Cell, place, place_of) -> list[RunRecord]:
    """The complete runs behind ``cell``: those ``place_of(config)`` puts at ``place`` with the chosen setting."""
    return [
        r
        for r in records
        if r.complete
        and place_of(r.config) == place
        and all(get(r.config, k) == v for k, v in cell.chosen.items())
    ]


def reported_on(cells: dict, records: list[RunRecord], place_of, metric: str, selection=None) -> dict:
    """``cells`` selected on one metric (a validation loss) holding another (``metric``, the test loss) over each
    chosen setting's runs: mean, sample std and n; ``candidates`` keep the selection metric's means. With the
    ``selection`` the cells were chosen by, its held-out seeds' runs are left out (:func:`tuning_runs`), as they
    were from the choice."""
    records = tuning_runs(records, selection) if selection is not None else records
    out = {}
    for place, cell in cells.items():
        vals = [float(r.summary["metrics"][metric]) for r in chosen_runs(records, cell, place, place_of)]
        out[place] = dataclasses.replace(
            cell, mean=float(np.mean(vals)), std=sample_std(vals), n=len(vals), values=vals
        )
    return out
