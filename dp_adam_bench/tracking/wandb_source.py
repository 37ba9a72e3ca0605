"""Runs read back from the W&B API, as the run store's ``RunRecord`` objects, so reports can aggregate them.

Why: a sweep on a cluster logs to W&B from many machines; the tables should not need the run folders copied
back. Every W&B run of an experiment (its W&B group, see :func:`~dp_adam_bench.tracking.wandb_logger.run_labels`)
becomes one record:

* ``config`` — the run's W&B config, which the trainer sets to the resolved run config (``config.yaml``);
* ``summary`` — ``summary.json``, which the logger mirrors into the W&B summary at the end of the run (verbatim,
  as a JSON string under :data:`~dp_adam_bench.tracking.wandb_logger.SUMMARY_JSON_KEY`; the top-level summary
  keys are used when the string is missing). A run without ``status: complete`` is incomplete, as locally;
* ``metrics()`` — the run's full history (``scan_history``, never the sampled ``history``), one row per logged
  step with ``step`` = W&B's ``_step``, fetched when first asked for.

What W&B does not have: the ``diag/`` keys (diagnostics computed on private examples) of runs logged with
``logger.share_private_diagnostics=false``, the default, and their summaries' records computed on private examples
(:data:`~dp_adam_bench.tracking.wandb_logger.PRIVATE_SUMMARY_KEYS`). Such a record says so
(:attr:`WandbRunRecord.diagnostics_shared` is False), and :func:`dp_adam_bench.tracking.sources.load_runs` prints a
note naming them: a table built from ``diag/`` keys (tang_table1 and tang_fig2, ganesh_figs4_6, ganesh_steps,
ganesh_horizon, ganesh_fig3's scale-then-privatize section) needs their run folders (``--source local``, or
``both`` with the folders present). Runs logged before the split (no such key in their config) did send their
``diag/`` keys and read as shared.

One run id can have several W&B runs: a run killed and resumed from its checkpoint, or rerun with
``train.force=true``, starts a new W&B run under the same name. The local store has one folder per run id, so the
W&B runs of one name are folded into one record: the summary of the latest complete one (else the latest), and a
history that, like ``metrics.jsonl`` after a resume, keeps the earlier runs' rows only up to the step where the
next run started.

Which source the reports read (``dp-adam-bench report --source local|wandb|both``) is chosen by
:func:`dp_adam_bench.tracking.sources.load_runs`; the local store stays the default and needs no network.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import yaml

from dp_adam_bench.paths import CONFIG_DIR
from dp_adam_bench.tracking.run_store import RunRecord, json_safe
from dp_adam_bench.tracking.wandb_logger import SUMMARY_JSON_KEY

PROJECT_ENV = "DP_ADAM_BENCH_WANDB_PROJECT"
# Seconds before a W&B API request is given up (the default retries for minutes when the network is down).
API_TIMEOUT_S = 20


class WandbSourceError(RuntimeError):
    """Runs cannot be read from W&B (no API key, no network, no such project or group)."""


def default_project() -> str:
    """``ENTITY/PROJECT`` (or ``PROJECT``) to read when none is given: ``$DP_ADAM_BENCH_WANDB_PROJECT``, else the
    project the trainer logs to (``configs/logger/default.yaml``)."""
    if os.environ.get(PROJECT_ENV):
        return os.environ[PROJECT_ENV]
    with open(CONFIG_DIR / "logger" / "default.yaml") as fh:
        wb = (yaml.safe_load(fh) or {}).get("wandb") or {}
    project = wb.get("project") or os.environ.get("WANDB_PROJECT") or "dp-adam-bench"  # as the logger's
    entity = wb.get("entity") or os.environ.get("WANDB_ENTITY")
    return f"{entity}/{project}" if entity else project


class WandbRunRecord(RunRecord):
    """A ``RunRecord`` whose metrics are the history of one or more W&B runs, fetched on first use."""

    def __init__(self, path: Path, config: dict, summary: dict | None, history_runs: list):
        super().__init__(path, config, summary)
        self._history_runs = history_runs
        self._rows: list[dict] | None = None

    @property
    def diagnostics_shared(self) -> bool:
        """Whether the run sent its ``diag/`` keys to W&B: ``logger.share_private_diagnostics`` of its config, True
        for a run logged before that key existed (it sent them all)."""
        logger = (self.config or {}).get("logger") or {}
        return bool(logger.get("share_private_diagnostics", True))

    def metrics(self) -> list[dict]:
        import wandb

        if self._rows is None:
            rows: list[dict] = []
            for run in self._history_runs:  # oldest first; a later run restarts at its first logged step
                try:
                    own = history_rows(run)
                except (wandb.errors.Error, OSError) as err:  # wandb's errors, or requests' (OSError)
                    raise WandbSourceError(f"cannot read the history of W&B run {self.path}: {err}") from err
                if own:
                    rows = [r for r in rows if r["step"] < own[0]["step"]]
                rows += own
            self._rows = rows
        return [dict(r) for r in self._rows]


def history_rows(run) -> list[dict]:
    """A W&B run's full history as ``metrics.jsonl`` rows: ``step`` from ``_step``, W&B's own ``_`` keys dropped,
    NaN/inf as None (as the run store writes them)."""
    rows = []
    for row in run.scan_history():
        values = {k: v for k, v in dict(row).items() if not k.startswith("_")}
        if not values or row.get("_step") is None:
            continue
        rows.append(json_safe({"step": int(row["_step"]), **values}))
    rows.sort(key=lambda r: r["step"])
    return rows


def run_summary(run) -> dict | None:
    """The run's ``summary.json`` as the logger mirrored it; None when the run never wrote one."""
    raw = getattr(run, "summary_metrics", None)
    if raw is None:
        raw = run.summary
    raw = dict(raw or {})
    text = raw.get(SUMMARY_JSON_KEY)
    if isinstance(text, str):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    summary = {k: v for k, v in raw.items() if not k.startswith("_") and k != SUMMARY_JSON_KEY}
    return json_safe(summary) if "status" in summary else None


def run_config(run) -> dict:
    return {k: v for k, v in dict(run.config or {}).items() if not k.startswith("_")}


def records_from_runs(runs, base: Path) -> list[WandbRunRecord]:
    """Fold W&B runs (already filtered to one experiment) into one record per run name, sorted by name."""
    by_name: dict[str, list] = defaultdict(list)
    for run in runs:
        by_name[run.name or run.id].append(run)
    records = []
    for name in sorted(by_name):
        chain = sorted(by_name[name], key=lambda r: str(getattr(r, "created_at", "") or ""))
        summaries = [run_summary(r) for r in chain]
        complete = [i for i, s in enumerate(summaries) if s and s.get("status") == "complete"]
        chosen = complete[-1] if complete else len(chain) - 1
        records.append(
            WandbRunRecord(base / name, run_config(chain[chosen]), summaries[chosen], chain[: chosen + 1])
        )
    return records


def _api(timeout: int):
    import wandb

    try:
        return wandb.Api(timeout=timeout)
    except wandb.errors.UsageError as err:
        raise WandbSourceError(
            f"cannot read runs from W&B: no API key ({str(err).rstrip('.')}). Set WANDB_API_KEY or run "
            "`wandb login`, or read the local run store (--source local, the default)."
        ) from err
    except wandb.errors.Error as err:
        raise WandbSourceError(
            "cannot reach W&B to read runs (network unavailable or credentials refused): "
            f"{str(err).rstrip('.')}. Read the local run store instead (--source local, the default)."
        ) from err


def load_wandb_runs(experiment: str, project: str | None = None, *, api=None) -> list[WandbRunRecord]:
    """Every W&B run of ``experiment`` (its W&B group) in ``project`` (``ENTITY/PROJECT``; default
    :func:`default_project`), complete or not, as records the reports aggregate like local ones."""
    import wandb

    project = project or default_project()
    api = api if api is not None else _api(API_TIMEOUT_S)
    try:
        runs = list(api.runs(project, filters={"group": experiment}))
    # wandb raises its own errors when the request fails, ValueError for a malformed path or an unknown project
    except (wandb.errors.Error, ValueError) as err:
        raise WandbSourceError(f"cannot list the runs of W&B project {project!r}: {err}") from err
    return records_from_runs(runs, Path(f"wandb:{project}") / experiment)
