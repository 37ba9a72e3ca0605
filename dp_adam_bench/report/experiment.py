"""The report of any experiment: ``dp-adam-bench report EXPERIMENT`` for a name that is not a table id (issue 58).

An experiment is whatever wrote run folders under ``<run store>/<experiment_name>/`` (a Hydra multirun, runs from
the API, a sweep preset, whose folder is its ``experiment_name``: ``ganesh_fig3_cpu``); the report reads them
(:meth:`ReportContext.load_runs`, so ``--source wandb`` reads the W&B group of that name) and writes
``results/EXPERIMENT.{csv,md,png}`` on the report skeleton (:class:`~dp_adam_bench.report.skeleton.Table`,
:class:`~dp_adam_bench.report.skeleton.SeedStats`):

* **Cells.** Runs are grouped by the config keys whose values vary across the experiment's runs, seeds pooled. The
  keys considered are those of :func:`dp_adam_bench.tracking.run_store.run_identity` (what determines a run's
  result) less :data:`POOLED_OR_BOOKKEEPING`, so that these never split cells: ``seed`` (pooled: the cell's
  spread), ``experiment_name`` (the folder itself), and what ``run_identity`` already leaves out: the logger
  (W&B mode, project, entity), ``paths`` (the run store), Hydra's output folders, ``train``'s operational keys
  (:data:`~dp_adam_bench.tracking.run_store.OPERATIONAL_TRAIN_KEYS`: threads, logging and evaluation intervals,
  checkpoints, resume, the engine checks) and keys added later still at the value older runs computed with. A
  key missing from some runs' configs (``optimizer.beta1`` of adambc beside sgd) varies like any other.
* **Columns.** Each cell is named by its varying keys less those whose value follows from another's
  (:func:`label_keys`: ``optimizer.lr`` of a sweep over ``optimizer=sgd,adambc``, listed under "What else
  differs" instead); the group keys read as their override (``optimizer`` for ``optimizer.name``,
  ``noise`` for ``noise.kind``, ``task`` for ``task.name``). Then every final metric of the runs' ``summary.json``
  (its ``metrics``: one value a run, whatever trials it averaged) as mean and sample std over seeds
  (:data:`~dp_adam_bench.report.stats.STD_CONVENTION`) with n, and the run's privacy: epsilon and its accountant at
  delta (``summary.guarantee``), sigma, q (``privacy_plan.sampling_rate``: blank for a sampler without one) and the
  steps taken. Keys ending in ``_std`` in a summary's metrics are a run's spread over its own trials, not a
  metric: they are not averaged.
* **Comparisons** the user names: ``--compare KEY`` (every pair of cells that differ only along KEY) and
  ``--baseline KEY=VALUE`` (every other cell against the cell with that value that differs from it only along
  KEY). "Along KEY" lets KEY differ and the keys that are not columns and follow from it (choosing adambc instead
  of sgd also sets its learning rate and betas); a key swept across the choices is a column of its own and held
  fixed (:func:`along`); a group name (``optimizer``) stands for its field (``optimizer.name``). Each comparison
  is Welch's t-test over seeds (Welch 1947, Biometrika 34(1-2); :mod:`dp_adam_bench.report.stats`) with its
  degrees of freedom. There is no paper direction here: a comparison states the direction observed (the larger
  mean first for ``--compare``), and is **holds** (p < 0.05), **agrees, not decided** (p >= 0.05, with the seeds a cell
  that would decide it if the gap and spread seen were the truth) or **untested** (fewer than 2 seeds a cell, or
  a value not finite): the subset of the five-state rule (:func:`stats.state`) that an observed direction can
  take.
* **Runs left out** are listed, never dropped silently: a run without a complete summary (running, killed, stopped
  by a check, a privacy mismatch) and a complete run whose final metric is not finite (diverged). A config refused
  before training leaves no run folder (:func:`dp_adam_bench.train.train` refuses before creating it), so there is
  nothing of it to list. A complete run with the trainer's divergence note but a finite metric stays in its cell,
  and its note is listed.
* **Figure:** the metric against the step from each run's ``metrics.jsonl`` (the key itself, else
  ``<metric>_mean``, which tasks with several trials log), one line a cell: the mean over its seeds at the steps
  they all logged, and the band from the lowest to the highest seed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml

from dp_adam_bench.paths import REPO_ROOT
from dp_adam_bench.report import expected, stats
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.expected import GROUP_FIELDS
from dp_adam_bench.report.experiment_spec import ExperimentSpec, PaperCell
from dp_adam_bench.report.skeleton import SeedStats, Table, gap
from dp_adam_bench.tracking.run_store import RunRecord, run_identity

#: config keys that never split cells: the seed is pooled (the cell's spread), the experiment's name is its folder;
#: the logger, paths, Hydra and train's operational keys are already outside :func:`run_identity`
POOLED_OR_BOOKKEEPING = ("seed", "experiment_name")
#: the default metric: the first of these the runs' summaries hold, else the first other metric by name
DEFAULT_METRICS = ("test_accuracy", "accuracy", "eval_accuracy", "test_loss", "eval_loss", "loss")
#: a key a run's config lacks (another optimizer's parameter)
MISSING = "—"
#: what a comparison of two cells can be when the direction is the one observed (:func:`stats.state`'s subset)
OBSERVED_STATES = {stats.HOLDS: "holds", stats.AGREES: stats.AGREES, stats.UNTESTED: "untested"}


# --------------------------------------------------------------------------------------------- finding the runs


def valid_name(name: str) -> bool:
    """An experiment name the report can read and write: one folder name (no separators, no leading dot or _)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.=,+-]*", name))


def find_runs(ctx: ReportContext, name: str) -> list[RunRecord]:
    """The runs of experiment ``name`` (its run store folder, or W&B group, from ``ctx``'s source), complete or not;
    ``[]`` for none or a name that is not one folder name. A sweep preset's runs are found by their folder, the
    preset's ``experiment_name`` (``ganesh_fig3_cpu``): the preset's own name is its table."""
    return ctx.load_runs(name) if valid_name(name) else []


def no_runs_error(name: str, ctx: ReportContext) -> ValueError:
    """The one-line refusal of a name that is neither a table, a group, nor an experiment with runs."""
    from dp_adam_bench.report import registry

    valid = [*registry.REPORTS.names(), *sorted(registry.GROUPS)]
    return ValueError(
        f"unknown table {name!r}, and no runs of an experiment named {name!r} in {ctx.where(name)}; "
        f"valid tables and groups: {', '.join(valid)}"
    )


# --------------------------------------------------------------------------------------------- cells


def flatten(node, prefix: str = "") -> dict[str, object]:
    """``{dotted key: leaf value}`` of a nested config (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, object] = {}
    for k, v in node.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def grouping_config(cfg: dict) -> dict[str, object]:
    """The flattened config keys a run is grouped by: :func:`run_identity` less :data:`POOLED_OR_BOOKKEEPING`."""
    ident = {k: v for k, v in run_identity(cfg).items() if k not in POOLED_OR_BOOKKEEPING}
    return flatten(ident)


def canonical(value) -> object:
    """A value compared up to float formatting; lists by their JSON."""
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True, default=str)
    return expected.canonical(value)


def varying_keys(configs: Sequence[dict[str, object]]) -> list[str]:
    """The keys whose value (or presence) differs across ``configs``: the group fields first, then in config
    order."""
    order: list[str] = []
    for c in configs:
        order += [k for k in c if k not in order]
    varying = [k for k in order if len({canonical(c.get(k, MISSING)) for c in configs}) > 1]
    groups = [k for k in GROUP_FIELDS.values() if k in varying]
    return groups + [k for k in varying if k not in groups]


def label_keys(keys: Sequence[str], points: Sequence[tuple]) -> list[str]:
    """The keys that name the cells: ``keys`` less those whose value follows from one other kept key's value (from
    the last key back, so the group fields, first, are kept): ``optimizer.lr`` and ``optimizer.beta1`` of a sweep
    over ``optimizer=sgd,adambc`` follow from ``optimizer.name``; swept across both optimizers, ``optimizer.lr``
    follows from none and stays. Dropping a key that follows from a kept one never merges two cells."""
    kept = list(range(len(keys)))
    for i in reversed(range(len(keys))):
        for j in (j for j in kept if j != i):
            follows: dict[object, object] = {}
            if all(follows.setdefault(p[j], p[i]) == p[i] for p in points):
                kept.remove(i)
                break
    return [keys[j] for j in kept]


def short(key: str) -> str:
    """A group field as its override name (``optimizer.name`` -> ``optimizer``), other keys as they are."""
    return {v: k for k, v in GROUP_FIELDS.items()}.get(key, key)


def shown(value) -> str:
    return "null" if value is None else str(value)


@dataclass
class Cell:
    """The runs of one value of the varying keys: ``values`` (key -> value as configured, :data:`MISSING` when the
    run's config lacks it), ``runs`` (complete, the metric finite) and ``left_out`` ((run, why) for the others)."""

    values: dict[str, object]
    runs: list[RunRecord] = field(default_factory=list)
    left_out: list[tuple[RunRecord, str]] = field(default_factory=list)

    def name(self, keys: Sequence[str]) -> str:
        """``optimizer=adambc noise=bandmf``: the cell's values of ``keys``."""
        return " ".join(f"{short(k)}={shown(self.values[k])}" for k in keys) or "all runs"


def final(run: RunRecord, metric: str) -> float | None:
    """A complete run's final ``metric`` (None when absent or not a number; NaN and inf are stored as None)."""
    value = ((run.summary or {}).get("metrics") or {}).get(metric)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def why_left_out(run: RunRecord, metric: str) -> str | None:
    """Why a run is not in its cell (None: it is): not complete, with its status and reason, or diverged."""
    if not run.complete:
        stopped = run.path / "stopped_by_check.json"
        if stopped.exists():
            try:
                return f"stopped by a check: {json.loads(stopped.read_text()).get('error', '')}".rstrip(": ")
            except (json.JSONDecodeError, OSError):
                return "stopped by a check"
        if not run.summary:
            return "not finished: no summary.json (running, killed or failed)"
        return f"not complete: status {run.summary.get('status')!r}"
    value = final(run, metric)
    if value is None or not math.isfinite(value):
        note = (
            run.summary.get("diverged") or f"final {metric} is {value if value is not None else 'not finite'}"
        )
        return f"diverged: {note}"
    return None


def group_cells(runs: Sequence[RunRecord], metric: str) -> tuple[list[str], list[Cell]]:
    """``(varying keys, cells)``: every run in one cell (complete or not), the cells in the order first seen."""
    configs = [grouping_config(r.config) for r in runs]
    keys = varying_keys(configs)
    cells: dict[tuple, Cell] = {}
    for run, cfg in zip(runs, configs, strict=True):
        values = {k: cfg.get(k, MISSING) for k in keys}
        cell = cells.setdefault(tuple(canonical(v) for v in values.values()), Cell(values))
        why = why_left_out(run, metric)
        if why is None:
            cell.runs.append(run)
        else:
            cell.left_out.append((run, why))
    return keys, list(cells.values())


def order_key(value) -> tuple:
    """Sorts numbers by value before every other value, those by their text."""
    v = canonical(value)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, str(v))


def ordered(cells: Sequence[Cell], keys: Sequence[str], labels: Sequence[str]) -> list[Cell]:
    """The cells sorted by their label values (numbers by value), then by the other varying keys."""
    first = [*labels, *(k for k in keys if k not in labels)]
    return sorted(cells, key=lambda c: tuple(order_key(c.values[k]) for k in first))


# --------------------------------------------------------------------------------------------- the table


def pick_metric(runs: Sequence[RunRecord], metric: str | None) -> tuple[str, str]:
    """``(metric, why)``: ``metric`` if given and some complete run has it (else ValueError naming those there are),
    otherwise the first of :data:`DEFAULT_METRICS` they have, else their first metric by name."""
    there = sorted({k for r in runs if r.complete for k in (r.summary.get("metrics") or {})})
    names = [k for k in there if not k.endswith("_std")]
    if metric is not None:
        if metric not in there:
            raise ValueError(
                f"--metric {metric!r}: no complete run has it; the runs' metrics: {', '.join(there)}"
            )
        return metric, "--metric"
    for m in DEFAULT_METRICS:
        if m in names:
            return m, f"the default: the first of {', '.join(DEFAULT_METRICS)} the runs have"
    if not names:
        raise ValueError("no complete run has a final metric in its summary.json: nothing to report yet")
    why = f"the default: none of {', '.join(DEFAULT_METRICS)} in the runs, the first metric by name"
    return names[0], why


def one_value(values: Sequence[object]) -> object:
    """The value all runs of a cell share; ``"a–b"`` when they differ (the lowest and highest); None for none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if len({canonical(v) for v in present}) == 1:
        return present[0]
    try:
        return f"{min(present):.4g}–{max(present):.4g}"
    except (TypeError, ValueError):
        return " / ".join(sorted({str(v) for v in present}))


def privacy(run: RunRecord) -> dict[str, object]:
    """A complete run's epsilon, accountant, delta, sigma, q and steps from its summary."""
    s = run.summary or {}
    plan = s.get("privacy_plan") or {}
    guarantee = s.get("guarantee") or {}
    private = s.get("private", True)
    return {
        "epsilon": guarantee.get("epsilon") if private else "not private",
        "accountant": guarantee.get("accountant") or plan.get("accountant"),
        "delta": guarantee.get("delta", s.get("delta")),
        "sigma": s.get("sigma", plan.get("sigma")),
        "q": plan.get("sampling_rate"),
        "steps": s.get("steps"),
    }


def cell_stats(cell: Cell, metric: str) -> SeedStats | None:
    """The cell's ``metric`` over its seeds (None for a cell without a run in it)."""
    vals = [final(r, metric) for r in cell.runs]
    return SeedStats.of(vals) if vals else None


def table_metrics(cells: Sequence[Cell], metric: str) -> list[str]:
    """The chosen metric first, then every other final metric of the cells' runs by name (no ``*_std``)."""
    others = sorted({k for c in cells for r in c.runs for k in r.summary.get("metrics") or {}} - {metric})
    return [metric, *(k for k in others if not k.endswith("_std"))]


def frame(
    cells: Sequence[Cell],
    labels: Sequence[str],
    metrics: Sequence[str],
    paper: dict[int, float] | None = None,
) -> pd.DataFrame:
    """One row a cell: its label values, each metric's mean and sample std with n (then, with ``paper``, the paper's
    number of the first metric and ours minus it, by the cell's index), then its privacy."""
    rows = []
    for i, cell in enumerate(cells):
        row: dict[str, object] = {short(k): shown(cell.values[k]) for k in labels}
        for m in metrics:
            vals = [v for v in (final(r, m) for r in cell.runs) if v is not None]
            cs = SeedStats.of(vals) if vals else None
            row[m] = cs.mean if cs else None
            row[f"{m}{stats.STD_SUFFIX}"] = cs.std if cs else None
            if m == metrics[0]:
                row["n"] = len(vals)
                if paper is not None:
                    row["paper"] = paper.get(i)
                    row["ours_minus_paper"] = cs.mean - paper[i] if cs and i in paper else None
        facts = [privacy(r) for r in cell.runs]
        row |= {
            k: one_value([f[k] for f in facts])
            for k in ("epsilon", "accountant", "delta", "sigma", "q", "steps")
        }
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------- comparisons


def follows(key: str, other: str, cells: Sequence[Cell]) -> bool:
    """Whether the cells' value of ``key`` follows from their value of ``other`` (one ``key`` value each)."""
    seen: dict[object, object] = {}
    return all(
        seen.setdefault(canonical(c.values[other]), canonical(c.values[key])) == canonical(c.values[key])
        for c in cells
    )


def along(key: str, keys: Sequence[str], labels: Sequence[str], cells: Sequence[Cell]) -> list[str]:
    """The varying keys a comparison along ``key`` lets differ: the key itself (a group, ``optimizer`` or
    ``optimizer.name``, is its field; a prefix, ``optimizer.betas``, every key under it), and the keys that are not
    columns and follow from it (choosing adambc instead of sgd also sets its learning rate and betas); a key swept
    across the choices is a column of its own and held fixed. ValueError naming the varying keys when ``key``
    names none of them."""
    group = short(key)
    if group in GROUP_FIELDS and GROUP_FIELDS[group] in keys:
        named = [GROUP_FIELDS[group]]
    else:  # a group whose choice is fixed stands for its keys that vary
        named = [k for k in keys if k == key or k.startswith(f"{group if group in GROUP_FIELDS else key}.")]
    if not named:
        raise ValueError(
            f"{key!r} does not vary across the runs; the keys that vary: {', '.join(keys) or 'none'}"
        )
    come = [
        k for k in keys if k not in labels and k not in named and any(follows(k, n, cells) for n in named)
    ]
    return named + come


def differ_only_along(a: Cell, b: Cell, alongs: Sequence[str]) -> bool:
    """Whether two cells have the same values outside ``alongs`` (and so differ only along them)."""
    return all(canonical(a.values[k]) == canonical(b.values[k]) for k in a.values if k not in alongs)


def comparison_line(
    a: Cell,
    b: Cell,
    names: Sequence[str],
    at: str,
    metric: str,
    suffix: str = "",
    paper: tuple[float | None, float | None] = (None, None),
) -> str:
    """``a`` against ``b`` (``at``: what both share). With two different paper numbers (``paper``: a's, b's) the
    claim is the paper's direction, judged in all five states (:func:`stats.state`); otherwise the direction
    observed, judged as if it were the claim (:data:`OBSERVED_STATES`): the means, the gap, Welch's test of a - b
    (its df) and the state."""
    sa, sb = cell_stats(a, metric), cell_stats(b, metric)
    na, nb = a.name(names), b.name(names) + suffix
    pa, pb = paper
    claimed = pa is not None and pb is not None and pa != pb
    if sa is None or sb is None:
        sign = ("<" if pa < pb else ">") if claimed else "vs"
        return f"- {na} {sign} {nb}{at} in {metric}: **untested** (a cell has no complete run)"
    g = gap(sa, sb)
    if claimed:
        sign = ">" if pa > pb else "<"
        state = stats.state(g if pa > pb else stats.flipped(g))
    else:
        sign = "=" if g.diff == 0 else (">" if g.diff > 0 else "<")
        observed = g if g.diff >= 0 else stats.flipped(g)
        state = OBSERVED_STATES.get(stats.state(observed, strict=False), stats.AGREES)
    detail = [f"{sa.mean:.4g} vs {sb.mean:.4g}, gap {g.diff:+.4g}", g.test()]
    if claimed:
        detail.append(f"paper: {pa:.4g} vs {pb:.4g}")
    if g.flag():
        detail.append(g.flag())
    elif g.untested():
        detail.append(g.untested())
    return f"- {na} {sign} {nb}{at} in {metric}: **{state}** ({'; '.join(detail)})"


def compare_lines(
    key: str,
    keys: Sequence[str],
    labels: Sequence[str],
    cells: Sequence[Cell],
    metric: str,
    paper: dict[int, float] | None = None,
) -> str:
    """Every pair of cells that differ only along ``key``, one line each, the larger mean first (the larger paper
    number first where both cells have one) (or why there is none)."""
    alongs = along(key, keys, labels, cells)
    names = [k for k in labels if k in alongs] or alongs
    paper = paper or {}
    lines = []
    for i, a in enumerate(cells):
        for j in range(i + 1, len(cells)):
            b = cells[j]
            if differ_only_along(a, b, alongs):
                pa, pb = paper.get(i), paper.get(j)
                if pa is not None and pb is not None and pa != pb:
                    swap = pb > pa
                else:
                    sa, sb = cell_stats(a, metric), cell_stats(b, metric)
                    swap = sa is not None and sb is not None and sb.mean > sa.mean
                first, second, numbers = (b, a, (pb, pa)) if swap else (a, b, (pa, pb))
                at = context(a, labels, alongs)
                lines.append(comparison_line(first, second, names, at, metric, paper=numbers))
    return (
        "\n".join(lines) or f"No two cells differ only along {key} (the keys that vary: {', '.join(keys)})."
    )


def context(cell: Cell, labels: Sequence[str], alongs: Sequence[str]) -> str:
    """`` at noise=bandmf``: the cell's other label values, which both sides of a comparison share."""
    rest = [k for k in labels if k not in alongs]
    return f" at {cell.name(rest)}" if rest else ""


def baseline_lines(
    spec: str,
    keys: Sequence[str],
    labels: Sequence[str],
    cells: Sequence[Cell],
    metric: str,
    paper: dict[int, float] | None = None,
) -> str:
    """Every cell against the baseline cell (``KEY=VALUE``) that differs from it only along KEY, one line each."""
    key, sep, raw = spec.partition("=")
    if not sep:
        raise ValueError(f"--baseline {spec!r}: give KEY=VALUE (--baseline optimizer=sgd)")
    alongs = along(key, keys, labels, cells)
    field_key = GROUP_FIELDS.get(key, key)
    if field_key not in keys:
        raise ValueError(
            f"--baseline {spec!r}: {field_key} does not vary; the keys that vary: {', '.join(keys)}"
        )
    want = canonical(yaml.safe_load(raw) if raw else None)
    bases = [c for c in cells if canonical(c.values[field_key]) in (want, canonical(raw))]
    if not bases:
        seen = sorted({shown(c.values[field_key]) for c in cells})
        raise ValueError(f"--baseline {spec!r}: no cell has {field_key}={raw}; its values: {', '.join(seen)}")
    names = [k for k in labels if k in alongs] or alongs
    index = {id(c): i for i, c in enumerate(cells)}
    paper = paper or {}
    lines = [
        comparison_line(
            c,
            base,
            names,
            context(c, labels, alongs),
            metric,
            " (baseline)",
            paper=(paper.get(index[id(c)]), paper.get(index[id(base)])),
        )
        for base in bases
        for c in cells
        if c is not base and c not in bases and differ_only_along(c, base, alongs)
    ]
    return "\n".join(lines) or f"No cell differs from the baseline {spec} only along {key}."


# --------------------------------------------------------------------------------------------- paper numbers


def resolve_key(name: str, keys: Sequence[str], where: str) -> str:
    """The varying key a spec's ``name`` stands for: itself, a group's field (``optimizer`` -> ``optimizer.name``)
    or the one varying key with that short name; a ValueError naming the keys that vary otherwise."""
    if name in keys:
        return name
    if GROUP_FIELDS.get(name) in keys:
        return GROUP_FIELDS[name]
    by_short = [k for k in keys if short(k) == name]
    if len(by_short) == 1:
        return by_short[0]
    raise ValueError(
        f"{where}: {name!r} does not vary across the runs; the keys that vary: {', '.join(keys)}"
    )


def paper_numbers(
    spec: ExperimentSpec, keys: Sequence[str], cells: Sequence[Cell]
) -> tuple[dict[int, float], list[PaperCell]]:
    """``({cell index: the paper's number}, the paper cells that match no cell)``. A paper cell applies to every
    cell whose values it names; a cell named by two paper cells is a ValueError (which number is its?)."""
    numbers: dict[int, float] = {}
    unmatched = []
    for n, pc in enumerate(spec.paper):
        where = f"--spec {spec.path}: paper.cells[{n}]"
        want = {resolve_key(k, keys, where): v for k, v in pc.where.items()}
        hits = [
            i
            for i, c in enumerate(cells)
            if all(
                canonical(c.values[k]) == canonical(v) or shown(c.values[k]) == str(v)
                for k, v in want.items()
            )
        ]
        for i in hits:
            if i in numbers:
                raise ValueError(
                    f"{where} ({pc.label()}) names the cell {cells[i].name(keys)}, as another does"
                )
            numbers[i] = pc.value
        if not hits:
            unmatched.append(pc)
    return numbers, unmatched


def unmatched_section(unmatched: Sequence[PaperCell], source: str | None) -> str:
    return "\n".join(f"- {pc.label()}: {pc.value:.4g} ({source})" for pc in unmatched)


# --------------------------------------------------------------------------------------------- figure and notes


def curve(run: RunRecord, metric: str) -> dict[int, float]:
    """``{step: value}`` of ``metric`` (else ``<metric>_mean``) in a run's ``metrics.jsonl``, finite values only."""
    out = {}
    for row in run.metrics():
        value = row.get(metric, row.get(f"{metric}_mean"))
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in row:
            out[int(row["step"])] = float(value)
    return out


def learning_curves(
    cells: Sequence[Cell], labels: Sequence[str], metric: str, name: str, out: Path
) -> Path | None:
    """``<out>/<name>.png``: each cell's mean ``metric`` against the step at the steps all its seeds logged, with
    the band from its lowest to its highest seed; None when no run logged the metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dp_adam_bench.report.common import save_figure

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    for cell in cells:
        curves = [curve(r, metric) for r in cell.runs]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not steps:
            continue
        ys = [[c[s] for c in curves] for s in steps]
        mean = [math.fsum(y) / len(y) for y in ys]
        line = ax.plot(steps, mean, label=f"{cell.name(labels)} (n = {len(curves)})")[0]
        ax.fill_between(steps, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{name}: mean over seeds, band from the lowest to the highest seed", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, name, out)


def left_out_section(cells: Sequence[Cell], labels: Sequence[str]) -> str:
    """The runs not in the table's numbers, one line each: run folder, cell, why."""
    return "\n".join(f"- `{r.path.name}` ({c.name(labels)}): {why}" for c in cells for r, why in c.left_out)


def differs_section(cells: Sequence[Cell], keys: Sequence[str], labels: Sequence[str]) -> str:
    """The varying keys the columns do not show (their values follow from those shown), cell by cell (the keys a
    cell's runs lack left out)."""
    rest = [k for k in keys if k not in labels]
    if not rest:
        return ""
    return "\n".join(
        f"- {c.name(labels)}: "
        + ", ".join(f"{k}={shown(c.values[k])}" for k in rest if c.values[k] != MISSING)
        for c in cells
    )


def notes(cells: Sequence[Cell]) -> list[str]:
    """Where the numbers come from, and what a blank means."""
    out = [
        f"Each metric is the mean and {stats.STD_CONVENTION} of the runs' final value (summary.json's metrics, one "
        "value a run); n counts the cell's complete runs with a finite final value; a metric's own *_std keys (a "
        "run's spread over its trials) are not averaged.",
        "epsilon at delta under the run's accountant (summary.json's guarantee); sigma the noise multiplier; q the "
        "privacy plan's sampling rate (blank: the sampler has none, e.g. single_pass, accounted without "
        "amplification); steps those taken. A range a–b: the cell's runs differ.",
        "Cells: the runs grouped by the config keys that vary across them, seeds pooled; seed, experiment_name, the "
        "logger, paths and train's operational keys never split a cell (dp_adam_bench/report/experiment.py).",
    ]
    kept = [
        f"`{r.path.name}`: {r.summary['diverged']}"
        for c in cells
        for r in c.runs
        if r.summary.get("diverged")
    ]
    if kept:
        out.append(
            "Kept in their cells with a divergence note (their final value is finite): " + "; ".join(kept)
        )
    return out


# --------------------------------------------------------------------------------------------- the build


def where(ctx: ReportContext, folder: str) -> str:
    """Where the runs were read, a run store inside the checkout named relative to it (``runs/<name>``)."""
    return ctx.where(folder).replace(f"{REPO_ROOT}/", "")


def command_line(
    name: str,
    metric: str | None,
    compare: Sequence[str],
    baseline: Sequence[str],
    spec: str | None = None,
) -> str:
    """The command that regenerates the report."""
    parts = ["dp-adam-bench report", name]
    parts += [f"--spec {spec}"] if spec else []
    parts += [f"--metric {metric}"] if metric else []
    parts += [f"--compare {k}" for k in compare] + [f"--baseline {b}" for b in baseline]
    return " ".join(parts)


def build_experiment(
    name: str,
    ctx: ReportContext,
    *,
    metric: str | None = None,
    compare: Sequence[str] = (),
    baseline: Sequence[str] = (),
    spec: ExperimentSpec | None = None,
) -> list[Path]:
    """Write ``<results>/<name>.{csv,md,png}`` from the runs of experiment ``name`` (see the module docstring); a
    ValueError in one line when it has none, or for an option the runs cannot answer. ``spec``: a spec file's
    metric (the command line's wins), comparisons (added to the command line's) and paper numbers
    (:mod:`dp_adam_bench.report.experiment_spec`)."""
    from dp_adam_bench.report.registry import results_for

    spec = spec or ExperimentSpec()
    chosen_metric = metric
    metric = metric or spec.metric
    compare, baseline = [*spec.compare, *compare], [*spec.baseline, *baseline]
    runs = find_runs(ctx, name)
    if not runs:
        raise no_runs_error(name, ctx)
    metric, why = pick_metric(runs, metric)
    if chosen_metric is None and spec.metric is not None:
        why = f"--spec {spec.path}"
    keys, cells = group_cells(runs, metric)
    labels = label_keys(keys, [tuple(canonical(c.values[k]) for k in keys) for c in cells])
    cells = ordered(cells, keys, labels)
    paper, unmatched = paper_numbers(spec, keys, cells) if spec.paper else (None, [])
    out = results_for(ctx.profile, ctx.out)
    table = frame(cells, labels, table_metrics(cells, metric), paper)
    sections = [
        (f"Comparisons along {k} ({metric})", compare_lines(k, keys, labels, cells, metric, paper))
        for k in compare
    ]
    sections += [
        (f"Against the baseline {b} ({metric})", baseline_lines(b, keys, labels, cells, metric, paper))
        for b in baseline
    ]
    if unmatched:
        sections.append(
            (f"Paper numbers with no cell here ({len(unmatched)})", unmatched_section(unmatched, spec.source))
        )
    if compare or baseline:
        sections.append(("How a comparison is judged", verdict_rule(bool(paper))))
    if differs_section(cells, keys, labels):
        sections.append(("What else differs between the cells", differs_section(cells, keys, labels)))
    left = left_out_section(cells, labels)
    sections.append(
        (
            f"Runs not in the numbers ({sum(len(c.left_out) for c in cells)})",
            left or "None: every run is complete.",
        )
    )
    complete = sum(len(c.runs) for c in cells)
    setting = (
        f"{len(runs)} runs of experiment `{name}` ({where(ctx, name)}), {complete} in the numbers, in "
        f"{len(cells)} cells by {', '.join(short(k) for k in labels) or 'nothing (one cell)'}; metric `{metric}` "
        f"({why})."
    )
    if paper is not None:
        setting += (
            f" Paper: {spec.source}, {len(spec.paper) - len(unmatched)} of its {len(spec.paper)} numbers beside "
            f"{len(paper)} cells of ours (column `paper`; `ours_minus_paper` in {metric})."
        )
    figure = learning_curves(cells, labels, metric, name, out)
    return Table(
        name,
        f"Experiment {name}: {metric} over seeds",
        command_line(
            name, chosen_metric, compare[len(spec.compare) :], baseline[len(spec.baseline) :], spec.path
        ),
        table,
        setting=setting,
        notes=notes(cells),
        figure=figure,
        extra_sections=sections,
    ).write(out)


def verdict_rule(paper: bool = False) -> str:
    """The rule the comparison lines follow, in words (opening as the other tables' rule note does); ``paper``: some
    comparisons are between cells with paper numbers, judged in the paper's direction."""
    if paper:
        return (
            "- Verdicts (dp_adam_bench/report/stats.py): Welch's two-sided t-test over seeds (Welch-Satterthwaite "
            "df, printed). Between two cells with different paper numbers the claim is the paper's direction: holds "
            f"(p < {stats.LEVEL:g}), agrees, not decided (p >= {stats.LEVEL:g}), disagrees, not decided (the "
            f"other direction, p >= {stats.LEVEL:g}), contradicted (the other direction, p < {stats.LEVEL:g}); "
            "otherwise the direction observed is stated, holds or agrees, not decided. Untested with fewer than 2 "
            "seeds a cell or a value not finite."
        )
    return (
        "- Verdicts (dp_adam_bench/report/stats.py), in the direction observed (there is no paper direction to "
        f"check): Welch's two-sided t-test over seeds (Welch-Satterthwaite df, printed); holds when p < "
        f"{stats.LEVEL:g}; agrees, not decided when p >= {stats.LEVEL:g} (with the seeds a cell that would decide "
        "it if the gap and spread seen were the truth); untested with fewer than 2 seeds a cell or a value not finite."
    )
