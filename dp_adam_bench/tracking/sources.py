"""Where reports read runs from: the local run store, the W&B API, or both merged.

The run store (:mod:`.run_store`) knows nothing of W&B and the W&B reader (:mod:`.wandb_source`) nothing of the
other sources; this module is the one place that chooses between them, so switching the source switches every
table at once (``dp-adam-bench report --source local|wandb|both``).
"""

from __future__ import annotations

from pathlib import Path

from dp_adam_bench.tracking.run_store import RunRecord, load_local_runs
from dp_adam_bench.tracking.wandb_source import WandbSourceError, default_project, load_wandb_runs

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
    """
    check_source(source)
    if source == "local":
        return load_local_runs(root, experiment)
    project = project or default_project()
    remote = load_wandb_runs(experiment, project)
    if source == "both":
        return merge_records(load_local_runs(root, experiment), remote)
    if not remote:
        raise WandbSourceError(
            f"no W&B runs in group {experiment!r} of project {project!r} (read the run store with --source local)"
        )
    return remote


def merge_records(local: list[RunRecord], remote: list[RunRecord]) -> list[RunRecord]:
    """Local and W&B records of one experiment, one per run id (the folder / W&B run name): the local one when it
    is complete (it also has the diagnostics files), else a complete W&B one, else whichever exists."""
    merged: dict[str, RunRecord] = {r.path.name: r for r in remote}
    for r in local:
        other = merged.get(r.path.name)
        if other is None or r.complete or not other.complete:
            merged[r.path.name] = r
    return [merged[k] for k in sorted(merged)]
