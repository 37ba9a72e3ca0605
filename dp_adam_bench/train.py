"""Training entry point: ``python -m dp_adam_bench.train task=... optimizer=... noise=... [experiment=...]``.

Also ``dp-adam-bench train ...``. Hydra composes ``configs/``; every run writes one folder under
``runs/<experiment_name>/<run_id>/`` (see :mod:`dp_adam_bench.tracking.run_store`) and logs the same metrics to
W&B (offline unless a key is set). A complete run folder is skipped unless ``train.force=true``, so a relaunched
sweep only runs what is missing.

Data-parallel: ``torchrun --nproc_per_node=N -m dp_adam_bench.train ...`` (model tasks; see
:mod:`dp_adam_bench.engine.distributed`). Rank 0 decides whether the run is complete, creates the folder and logs;
the other ranks train alongside it and write nothing.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from dp_adam_bench.config import ConfigError, validate
from dp_adam_bench.paths import CONFIG_DIR, runs_dir
from dp_adam_bench.tracking.run_store import RunFolder, RunLockedError, is_complete, run_id
from dp_adam_bench.tracking.wandb_logger import WandbLogger

log = logging.getLogger("dp_adam_bench.train")

# Keys that configure the sweep or the report, not the run itself.
_NOT_RUN_KEYS = ("sweep", "profiles")


def run_config(cfg: DictConfig) -> dict:
    """The resolved config of one run, as plain data."""
    data = OmegaConf.to_container(cfg, resolve=True)
    for k in _NOT_RUN_KEYS:
        data.pop(k, None)
    if data["noise"]["kind"] == "none":  # non-private: record what actually ran
        data["privacy"] = {**data["privacy"], "sigma": 0.0, "clip": None}
    return data


def train(cfg: DictConfig) -> dict | None:
    """Run one configuration (already composed); returns the summary, or None if the run was already complete
    (or, data-parallel, on ranks other than 0: their result is rank 0's).

    Everything that can be refused is refused before the run folder exists: the config (:func:`validate`), the
    task's data, and the privacy plan (batch larger than the data set, a budget the run cannot meet, a noise
    mechanism that cannot fit in memory, ...)."""
    from dp_adam_bench.engine import distributed, trainer

    data = run_config(cfg)
    validate(data)
    ddp = distributed.setup(data["train"].get("distributed", "auto"), data["train"].get("device", "auto"))
    root, name, rid = cfg.paths.runs or runs_dir(), data["experiment_name"], run_id(data)
    # rank 0 decides for all: its folder writes below must not change another rank's answer
    if _skip(ddp, is_complete(RunFolder.folder(root, name, rid)) and not cfg.train.force, root, name, rid):
        return None
    run_cfg = OmegaConf.create(data)
    try:
        prepared = trainer.build(run_cfg)
    except ConfigError:
        raise
    except ValueError as err:  # a task or variant refusing one of its fields
        raise ConfigError(str(err)) from err
    try:
        lock = (
            RunFolder.acquire(root, name, rid) if ddp.is_main else None
        )  # RunLockedError if running elsewhere
    except BaseException:
        prepared.backend.close()
        raise
    # under the lock: another launch may have finished the run while this one prepared
    if _skip(ddp, lock is not None and is_complete(lock.path) and not cfg.train.force, root, name, rid):
        prepared.backend.close()
        if lock is not None:
            lock.release()
        return None
    if not ddp.is_main:  # trains its share of every step; the run folder and W&B are rank 0's
        trainer.run(run_cfg, RunFolder.folder(root, name, rid), lambda step, metrics: None, prepared=prepared)
        return None
    folder = RunFolder.create(root, name, data, lock=lock)
    tags = [
        data["experiment_name"],
        data["task"]["name"],
        data["optimizer"]["name"],
        data["noise"]["kind"],
        data.get("profile", "cpu"),
    ]
    wb = WandbLogger(
        run_dir=folder.path,
        name=folder.path.name,
        group=data["experiment_name"],
        config=data,
        tags=tags,
        mode=cfg.logger.wandb.mode,
        project=cfg.logger.wandb.project,
        entity=cfg.logger.wandb.entity,
    )

    def log_both(step: int, metrics: dict) -> None:
        folder.log(step, metrics)
        wb.log(step, metrics)

    try:
        result = trainer.run(run_cfg, folder.path, log_both, prepared=prepared)
        folder.write_json("ledger.json", result["ledger"])
        summary = folder.finish(result, seed=int(data["seed"]), device=prepared.backend.device)
        wb.summary({k: v for k, v in result["metrics"].items()})
    finally:
        wb.finish()
        folder.close()
    log.info("run %s: %s", folder.path.name, summary["metrics"])
    return summary


def _skip(ddp, complete: bool, root, name: str, rid: str) -> bool:
    """Rank 0's answer to "is this run complete?", shared with every rank; says so when it is."""
    if not ddp.broadcast_object(complete):
        return False
    if ddp.is_main:
        print(
            f"complete, skipped: {RunFolder.folder(root, name, rid)} (train.force=true reruns it)",
            file=sys.stderr,
        )
    return True


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from dp_adam_bench.engine.checkpoint import CheckpointError
    from dp_adam_bench.placement import claim_gpu, skip_locked_run

    claim_gpu()  # a worker of a GPU sweep takes its GPU before anything touches CUDA; elsewhere a no-op

    try:
        train(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except RunLockedError as err:
        if skip_locked_run(err):  # a multirun job: its siblings still run
            return
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (CheckpointError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
