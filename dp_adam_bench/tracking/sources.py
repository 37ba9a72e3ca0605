"""Where reports read runs from: the local run store, the W&B API, or both merged.

The run store (:mod:`.run_store`) knows nothing of W&B and the W&B reader (:mod:`.wandb_source`) nothing of the
other sources; this module is the one place that chooses between them, so switching the source switches every
table at once (``dp-adam-bench report --source local|wandb|both``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from dp_adam_bench.tracking.run_store import PRIVATE_DIAGNOSTICS_FILE, RunRecord, load_local_runs
from dp_adam_bench.tracking.wandb_source import (
    WandbRunRecord,
    WandbSourceError,
    default_project,
    load_wandb_runs,
)

#: ``local``: the run store (the default, no network); ``wandb``: the W&B API only; ``both``: the run store,
#: completed by the W&B runs it lacks.
RUN_SOURCES = ("local", "wandb", "both")
RUN_SOURCE_ENV = "DP_ADAM_BENCH_RUN_SOURCE"


def check_source(source: object) -> str:
    """``source`` if it is one of :data:`RUN_SOURCES`, else a ValueError naming the valid ones."""
    if source not in RUN_SOURCES:
        raise ValueError(f"run source {source!r} is not one of: {', '.join(RUN_SOURCES)}")
    return source  # type: ignore[return-value]


def load_runs(
    root: Path, experiment: str, source: str = "local", project: str | None = None
) -> list[RunRecord]:
    """Every run of an experiment, complete or not, from ``source``.

    With ``wandb`` / ``both`` the experiment is the W&B group and ``project`` (``ENTITY/PROJECT``; default
    :func:`~dp_adam_bench.tracking.wandb_source.default_project`) the W&B project.

    A W&B run logged without sharing its private diagnostics has no ``diag/`` keys in its history; when any record
    returned is one, a note on stderr says so (:func:`unshared_diagnostics_note`).
    """
    check_source(source)
    if source == "local":
        return load_local_runs(root, experiment)
    project = project or default_project()
    remote = load_wandb_runs(experiment, project)
    if source == "both":
        records = merge_records(load_local_runs(root, experiment), remote)
    elif not remote:
        raise WandbSourceError(
            f"no W&B runs in group {experiment!r} of project {project!r} (read the run store with --source local)"
        )
    else:
        records = remote
    note = unshared_diagnostics_note(records, experiment)
    if note:
        print(note, file=sys.stderr)
    return records


def unshared_diagnostics_note(records: list[RunRecord], experiment: str) -> str | None:
    """One line when some of ``records`` are W&B runs without their ``diag/`` keys (logged with
    ``logger.share_private_diagnostics=false``, the default); None when there are none."""
    missing = [r.path.name for r in records if isinstance(r, WandbRunRecord) and not r.diagnostics_shared]
    if not missing:
        return None
    names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return (
        f"note: {len(missing)} W&B run(s) of {experiment!r} ({names}) carry no diag/ keys: diagnostics computed on "
        f"private examples stay in each run folder's {PRIVATE_DIAGNOSTICS_FILE} unless the run set "
        "logger.share_private_diagnostics=true; tables built from diag/ keys read those runs as having none "
        "(read the run folders: --source local, or both with the folders present)"
    )


def merge_records(local: list[RunRecord], remote: list[RunRecord]) -> list[RunRecord]:
    """Local and W&B records of one experiment, one per run id (the folder / W&B run name): the local one when it
    is complete (it also has the diagnostics files), else a complete W&B one, else whichever exists."""
    merged: dict[str, RunRecord] = {r.path.name: r for r in remote}
    for r in local:
        other = merged.get(r.path.name)
        if other is None or r.complete or not other.complete:
            merged[r.path.name] = r
    return [merged[k] for k in sorted(merged)]
