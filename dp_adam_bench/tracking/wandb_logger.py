"""W&B adapter: the same metrics as ``metrics.jsonl``, offline by default.

Mode: ``logger.wandb.mode`` if set (``offline``, ``online``, ``disabled``); otherwise ``online`` when
``WANDB_API_KEY`` is set and ``offline`` when not (without a key, ``wandb.init`` in its default mode fails at once
with a UsageError, see PITFALLS.md). Runs are grouped by experiment name and tagged with task / optimizer / noise /
profile so a sweep is one group in the UI.
"""

from __future__ import annotations

import os
from pathlib import Path


def resolve_mode(mode: str | None) -> str:
    if mode:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.wandb.mode must be offline, online or disabled, got {mode!r}")
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbLogger:
    def __init__(
        self,
        *,
        run_dir: Path,
        name: str,
        group: str,
        config: dict,
        tags: list[str],
        mode: str | None,
        project: str = "dp-adam-bench",
        entity: str | None = None,
    ):
        self.mode = resolve_mode(mode)
        self.run = None
        if self.mode == "disabled":
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=project,
            entity=entity,
            name=name,
            group=group,
            tags=tags,
            config=config,
            dir=str(run_dir),
            mode=self.mode,
            reinit="finish_previous",
        )

    def log(self, step: int, metrics: dict) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def summary(self, values: dict) -> None:
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = v

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None

    @property
    def run_path(self) -> str | None:
        return None if self.run is None else self.run.dir
