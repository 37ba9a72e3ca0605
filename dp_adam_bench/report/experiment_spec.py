"""What ``dp-adam-bench report EXPERIMENT --spec FILE`` reads from a YAML file: the metric, the comparisons and the
paper's numbers to print beside ours, so that a table with paper columns is the same machinery as a user's own
table (issue 58; :mod:`dp_adam_bench.report.experiment` builds it).

The file (every key optional)::

    metric: test_accuracy            # as --metric
    compare: [optimizer]             # as --compare, each KEY
    baseline: [optimizer=sgd]        # as --baseline, each KEY=VALUE
    paper:
      source: "Tang & Lecuyer 2023, arXiv:2312.14334, Fig. 1"   # printed with the numbers
      cells:                         # one number per cell of ours: its key values, and the paper's value
        - {optimizer: adambc, value: 0.641}
        - {optimizer: sgd, value: 0.604}

A paper cell names the cell of ours by the keys the report labels its cells with (the short names: ``optimizer``
for ``optimizer.name``, or any varying key in full). Its value appears in the table's ``paper`` column, with
``ours_minus_paper``; a comparison between two cells that both have a paper number is judged in the paper's
direction, with all five states of :func:`dp_adam_bench.report.stats.state` (it can then be contradicted); a
paper number that matches no cell is listed, never dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

#: the keys a spec file may have
KEYS = ("metric", "compare", "baseline", "paper")
#: the keys of its ``paper`` mapping
PAPER_KEYS = ("source", "cells")


@dataclass(frozen=True)
class PaperCell:
    """One number of the paper: ``where`` (key -> value naming a cell of ours) and its ``value``."""

    where: dict
    value: float

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.where.items())


@dataclass(frozen=True)
class ExperimentSpec:
    """A spec file's content (:func:`load_spec`); the empty spec is the command line alone."""

    metric: str | None = None
    compare: tuple[str, ...] = ()
    baseline: tuple[str, ...] = ()
    source: str | None = None
    paper: tuple[PaperCell, ...] = ()
    path: str | None = None


def _strings(name: str, value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where}: {name} = {value!r}: give a list of strings")
    return tuple(value)


def _paper_cell(i: int, raw, where: str) -> PaperCell:
    at = f"{where}: paper.cells[{i}]"
    if not isinstance(raw, dict) or "value" not in raw:
        raise ValueError(f"{at} = {raw!r}: give a mapping of the cell's keys and its value ({{optimizer: sgd, "
                         "value: 0.6}})")  # fmt: skip
    value = raw["value"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{at}.value = {value!r}: give a finite number")
    keys = {str(k): v for k, v in raw.items() if k != "value"}
    if not keys:
        raise ValueError(f"{at}: name the cell by at least one key beside its value")
    return PaperCell(keys, float(value))


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read and check a spec file; a ValueError in one line naming the file, the key and what is valid."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ValueError(f"--spec {path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--spec {path}: not YAML ({str(e).splitlines()[0]})") from None
    where = f"--spec {path}"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: give a mapping with any of {', '.join(KEYS)}")
    unknown = sorted(set(map(str, raw)) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(KEYS)}")
    metric = raw.get("metric")
    if metric is not None and (not isinstance(metric, str) or not metric):
        raise ValueError(f"{where}: metric = {metric!r}: give a metric name (a key of the runs' metrics)")
    paper = raw.get("paper") or {}
    if not isinstance(paper, dict):
        raise ValueError(f"{where}: paper = {paper!r}: give a mapping with {' and '.join(PAPER_KEYS)}")
    unknown = sorted(set(map(str, paper)) - set(PAPER_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key paper.{unknown[0]}; valid: {', '.join(PAPER_KEYS)}")
    cells = paper.get("cells") or []
    if not isinstance(cells, list):
        raise ValueError(f"{where}: paper.cells = {cells!r}: give a list of cells")
    source = paper.get("source")
    if cells and not (isinstance(source, str) and source.strip()):
        raise ValueError(
            f"{where}: paper.source: say where the paper's numbers come from (authors, year, table)"
        )
    return ExperimentSpec(
        metric=metric,
        compare=_strings("compare", raw.get("compare"), where),
        baseline=_strings("baseline", raw.get("baseline"), where),
        source=source,
        paper=tuple(_paper_cell(i, c, where) for i, c in enumerate(cells)),
        path=str(path),
    )
