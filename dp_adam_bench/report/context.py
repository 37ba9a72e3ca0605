"""What a report is built for: where it reads runs, where it writes, which profile. Passed to every report's
build function, so that nothing travels through environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dp_adam_bench.paths import results_dir, runs_dir
from dp_adam_bench.tracking.run_store import RunRecord
from dp_adam_bench.tracking.sources import check_source, load_runs

PROFILES = ("cpu", "paper")


@dataclass(frozen=True)
class ReportContext:
    """``profile``: cpu or paper; ``source``: local, wandb or both (:mod:`dp_adam_bench.tracking.sources`);
    ``out``: the folder the table's files go to; ``runs``: the run store; ``wandb_project``: ``ENTITY/PROJECT``
    for the wandb / both sources (None: the default project)."""

    profile: str = "cpu"
    source: str = "local"
    out: Path = field(default_factory=results_dir)
    runs: Path = field(default_factory=runs_dir)
    wandb_project: str | None = None

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"profile {self.profile!r} is not one of: {', '.join(PROFILES)}")
        check_source(self.source)
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "runs", Path(self.runs))

    def load_runs(self, experiment: str) -> list[RunRecord]:
        """Every run of ``experiment`` (its run store folder / W&B group), complete or not, from the source."""
        return load_runs(self.runs, experiment, self.source, self.wandb_project)

    def where(self, experiment: str) -> str:
        """Where the runs of ``experiment`` are read, for messages."""
        local = str(self.runs / experiment)
        project = self.wandb_project or "the default W&B project"
        return {
            "local": local,
            "wandb": f"W&B group {experiment!r} of {project}",
            "both": f"{local} or W&B group {experiment!r} of {project}",
        }[self.source]
