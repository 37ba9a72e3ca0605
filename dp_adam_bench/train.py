"""Training entry point: ``python -m dp_adam_bench.train task=... optimizer=... noise=... [experiment=...]``.

Also ``dp-adam-bench train ...``. Hydra composes ``configs/``; every run writes one folder under
``runs/<experiment_name>/<run_id>/`` (see :mod:`dp_adam_bench.tracking.run_store`) and logs the same metrics to
W&B (offline unless a key is set), except the ``diag/`` keys: diagnostics computed on the private training examples,
outside the accounted release, which go to the run folder's ``private_diagnostics.jsonl`` only (and to W&B too with
``logger.share_private_diagnostics=true``). A complete run folder is skipped, and a run with a checkpoint in its folder
resumes from it, so a relaunched sweep only runs what is missing; ``train.force=true`` reruns the run from scratch
(complete or not, its checkpoint ignored and removed), ``train.resume=false`` starts an incomplete run afresh.
Ctrl-C stops a run with one line saying how to go on (exit code 130).

Data-parallel: ``torchrun --nproc_per_node=N -m dp_adam_bench.train ...`` (model tasks; see
:mod:`dp_adam_bench.engine.distributed`). Rank 0 decides whether the run is complete, creates the folder and logs;
the other ranks train alongside it and write nothing.
"""

from __future__ import annotations

import difflib
import logging
import re
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from dp_adam_bench.config import ConfigError, validate
from dp_adam_bench.errors import PrivacyMismatch
from dp_adam_bench.paths import CONFIG_DIR, runs_dir
from dp_adam_bench.tracking.run_store import RunFolder, RunLock, RunLockedError, is_complete, run_id
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

    data = _checked_run_config(cfg)
    share = share_private_diagnostics(data)
    # force = from scratch: never resume (resume is an operational key, so the run id stays the same)
    if data["train"].get("force"):
        data["train"]["resume"] = False
    ddp = distributed.setup(data["train"].get("distributed", "auto"), data["train"].get("device", "auto"))
    root, name, rid = cfg.paths.runs or runs_dir(), data["experiment_name"], run_id(data)
    where = RunFolder.folder(root, name, rid)
    # rank 0 decides for all: its folder writes below must not change another rank's answer
    if _skip(ddp, is_complete(where) and not cfg.train.force, root, name, rid):
        return None
    # a second launch of a running run is refused now, not after the set-up (data, model, plan)
    if ddp.is_main:
        RunLock.check(where)
    run_cfg = OmegaConf.create(data)
    prepared = _prepare(run_cfg, where)
    if ddp.is_main:
        for line in prepared.plan.warnings:
            print(f"warning: {line}", file=sys.stderr)
    lock = _lock(ddp, prepared, root, name, rid)
    # under the lock: another launch may have finished the run while this one prepared
    if _skip(ddp, lock is not None and is_complete(lock.path) and not cfg.train.force, root, name, rid):
        prepared.backend.close()
        if lock is not None:
            lock.release()
        return None
    if not ddp.is_main:  # trains its share of every step; the run folder and W&B are rank 0's
        trainer.run(run_cfg, where, lambda step, metrics: None, prepared=prepared)
        return None
    return _train_in_folder(
        cfg, data, run_cfg, prepared, RunFolder.create(root, name, data, lock=lock), share
    )


def _checked_run_config(cfg: DictConfig) -> dict:
    """The run's config as plain data (:func:`run_config`), refused by :func:`validate` if it cannot run."""
    data = run_config(cfg)
    validate(data)
    return data


def _prepare(run_cfg: DictConfig, where):
    """:func:`dp_adam_bench.engine.trainer.build`: the task, model and plan, nothing written; a task or variant
    refusing one of its fields (ValueError) is a ConfigError."""
    from dp_adam_bench.engine import trainer

    try:
        return trainer.build(run_cfg, where)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _lock(ddp, prepared, root, name: str, rid: str):
    """Rank 0's lock on the run folder (RunLockedError if the run is running elsewhere; the prepared backend is
    closed then); None on other ranks."""
    try:
        return RunFolder.acquire(root, name, rid) if ddp.is_main else None
    except BaseException:
        prepared.backend.close()
        raise


def _train_in_folder(cfg: DictConfig, data: dict, run_cfg: DictConfig, prepared, folder, share: bool) -> dict:
    """Rank 0: train in the run folder, logging to it and to W&B; write the ledger and the summary (last), say
    the guarantee and any divergence, and fail on a participation mismatch once all of it is written."""
    from dp_adam_bench.engine import trainer
    from dp_adam_bench.engine.checkpoint import FILENAME as CHECKPOINT

    if data["train"].get("force"):  # a later resume must not pick up the replaced run's state
        (folder.path / CHECKPOINT).unlink(missing_ok=True)
    print(f"run folder: {folder.path}", file=sys.stderr, flush=True)
    wb = _wandb_logger(cfg, data, folder, share)

    def log_both(step: int, metrics: dict) -> None:
        # the folder splits the diag/ keys into private_diagnostics.jsonl; W&B gets them only when shared
        folder.log(step, metrics)
        wb.log(step, metrics)

    try:
        result = trainer.run(run_cfg, folder.path, log_both, prepared=prepared)
        verdict = (result.get("participation") or {}).get("verdict", "consistent")
        if verdict != "consistent":  # not "complete": a relaunch reruns it, reports leave it out
            result = {**result, "status": "privacy_mismatch"}
        folder.write_json("ledger.json", result["ledger"])
        summary = folder.finish(result, seed=int(data["seed"]), device=prepared.backend.device)
        wb.summary({k: v for k, v in result["metrics"].items()})
    finally:
        wb.finish()
        folder.close()
    log.info("run %s: %s", folder.path, summary["metrics"])
    if summary.get("guarantee"):
        print(guarantee_line(summary["guarantee"]), file=sys.stderr)
    if summary.get("diverged"):
        print(f"warning: {folder.path.name} {summary['diverged']}", file=sys.stderr)
    if verdict != "consistent":  # recorded in summary.json first; then the run fails in one line
        raise PrivacyMismatch(f"{folder.path.name}: participation ledger: {verdict}")
    return summary


def _wandb_logger(cfg: DictConfig, data: dict, folder, share: bool) -> WandbLogger:
    """The run's W&B logger (``logger.wandb.*``), grouped by experiment and tagged with the task, optimizer,
    noise and profile."""
    tags = [
        data["experiment_name"],
        data["task"]["name"],
        data["optimizer"]["name"],
        data["noise"]["kind"],
        data.get("profile", "cpu"),
    ]
    return WandbLogger(
        run_dir=folder.path,
        name=folder.path.name,
        group=data["experiment_name"],
        config=data,
        tags=tags,
        mode=cfg.logger.wandb.mode,
        project=cfg.logger.wandb.project,
        entity=cfg.logger.wandb.entity,
        share_private_diagnostics=share,
    )


def share_private_diagnostics(data: dict) -> bool:
    """``logger.share_private_diagnostics`` of a run config (false when absent): whether the ``diag/`` keys and the
    summary's records computed on private training examples (``PRIVATE_SUMMARY_KEYS`` of
    :mod:`dp_adam_bench.tracking.wandb_logger`: self-check, engine probe and watch) also go to W&B. A ConfigError
    (before the run folder exists) when it is not a boolean."""
    value = (data.get("logger") or {}).get("share_private_diagnostics", False)
    if not isinstance(value, bool):
        raise ConfigError(
            f"logger.share_private_diagnostics={value!r}; valid: false (the default: diagnostics computed on "
            "private examples stay in the run folder) or true (also send them to W&B)"
        )
    return value


def guarantee_line(g: dict) -> str:
    """``epsilon (rdp) = 4.729 at delta = 1e-05; privacy.epsilon_budget = 4.5 held under exact_gaussian (4.377)``: the
    run's epsilon named by its accountant, and the accountant of its budget or target (summary["guarantee"])."""
    eps = g.get("epsilon")
    text = (
        f"epsilon ({g['accountant']}) = {eps:.4g}"
        if eps is not None
        else f"epsilon ({g['accountant']}) failed"
    )
    text += f" at delta = {g['delta']:g}"
    exact = g.get("exact_gaussian_epsilon")
    for field, key in (("epsilon_budget", "budget_accountant"), ("target_epsilon", "target_accountant")):
        if g.get(field) is not None:
            acc = g[key]
            value = f" ({exact:.4g})" if acc == "exact_gaussian" and exact is not None else ""
            text += f"; privacy.{field} = {g[field]:g} met under {acc}{value}"
    for caveat in g.get("caveats") or []:  # e.g. a sampler the accountant does not model, delta >= 1/N
        text += f"; CAVEAT: {caveat}"
    return text


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


def ignored_overrides(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """One line per override the run ignores: ``privacy.*`` with ``noise=none`` (no noise, no clipping)."""
    if cfg.noise.kind != "none":
        return []
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
    return [
        f"note: {k}={OmegaConf.select(cfg, k)} is ignored: noise=none trains without noise or clipping (the run "
        "records sigma 0 and no clip norm)"
        for k in keys
        if k.startswith("privacy.")
    ]


def default_sampler_note(cfg: DictConfig, overrides: list[str]) -> str | None:
    """A note when independent noise runs on the root config's default sampler, ``single_pass``: fixed-size batches
    accounted without amplification by sampling (correct, but far from DP-SGD's Poisson accounting, which
    ``make_private`` defaults to). None when the command line or an experiment preset chose the sampler."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    if cfg.noise.kind != "independent" or keys & {"train.sampler", "experiment"}:
        return None
    if cfg.train.sampler != "single_pass":
        return None
    return (
        "note: noise=independent on the default train.sampler=single_pass (cyclic fixed-size batches) is accounted "
        "without amplification by sampling; for DP-SGD's Poisson accounting (make_private's default) set "
        "train.sampler=poisson train.steps=N"
    )


def compose_error(overrides: list[str]) -> str | None:
    """Why Hydra cannot compose the config from these overrides, in one line naming the override and what is
    valid (an unknown option of a group, a key that is not a field, an override that does not parse); None when it
    composes."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, MissingConfigException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override)
        except HydraException as err:
            return f"{override!r} does not parse as an override (key=value): {_one_line(err)}"
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            compose("config", overrides=list(overrides))
    except MissingConfigException as err:
        found = re.search(r"Could not (?:find|load) '(.+)/([^/']+)'", str(err))
        if found and err.options:
            group, option = found.groups()
            return f"{group}={option} is not an option of {group}; valid: {', '.join(err.options)}"
        return _one_line(err)
    except HydraException as err:
        key = getattr(err.__cause__, "full_key", None)
        if key and "not in struct" in str(err.__cause__):
            return _not_a_field(key, overrides)
        return hydra_error_line(err)
    return None


def hydra_error_line(err: BaseException) -> str:
    """A Hydra error in one line: its message without the config search path and links, and the OmegaConf error
    under it where the message does not say it (``Error merging override k=[0.1]`` hides "Cannot merge DictConfig
    with ListConfig", i.e. ``k`` holds a mapping)."""
    line, cause = _one_line(err), err.__cause__
    said = str(cause).splitlines()[0].strip() if cause is not None and str(cause).strip() else ""
    if said and said not in line:
        line = f"{line}: {said}"
    if said.startswith("Cannot merge DictConfig with"):
        line += " (that key holds a mapping: override its entries, <key>.<entry>=...)"
    return line


def _one_line(err: BaseException) -> str:
    skip = ("See https://", "Config search path", "provider=", "Set the environment variable")
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip() and not ln.strip().startswith(skip)]
    return "; ".join(lines)


def _not_a_field(key: str, overrides: list[str]) -> str:
    """``train.stpes=5 is not a config field (did you mean train.steps?); valid: ...``"""
    from hydra import compose, initialize_config_dir

    # the override that names the key, or a field under it (nosuch.key=3: Hydra reports `nosuch`)
    named = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    given = next(
        (o for o, k in zip(overrides, named, strict=True) if k == key or k.startswith(key + ".")), key
    )
    parent, _, leaf = key.rpartition(".")
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            base = compose("config", overrides=[o for o in overrides if o != given])
        node = OmegaConf.select(base, parent) if parent else base
        known = sorted(str(k) for k in node.keys())
    except Exception:  # the other overrides do not compose either: say what is known about this one
        known = []
    close = difflib.get_close_matches(leaf, known, n=1)
    hint = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
    valid = f"; valid fields of {parent or 'the config'}: {', '.join(known)}" if known else ""
    return f"{given} is not a config field{hint}{valid}"


def cli() -> None:
    """``python -m dp_adam_bench.train`` and ``dp-adam-bench train``: Hydra's main, with Hydra's own refusals of a
    single run's overrides (an unknown option of a group, a key typo) as one line and exit code 2 like every
    config error, instead of Hydra's many lines and exit code 1. Multirun (``-m``) and Hydra's flags go to Hydra
    as they are. Ctrl-C (KeyboardInterrupt) prints one line saying how to go on and exits with 130, the shell's
    code for SIGINT, instead of a traceback."""
    argv = sys.argv[1:]
    try:
        if argv and not any(a.startswith("-") for a in argv):
            err = compose_error(argv)
            if err:
                print(f"config error: {err}", file=sys.stderr)
                sys.exit(2)
        main()
    except KeyboardInterrupt as stop:
        print(interrupted_line(stop, RESUME_RUN), file=sys.stderr)
        sys.exit(130)


#: how a stopped run goes on (the line Ctrl-C prints instead of a traceback)
RESUME_RUN = (
    "run the same command again to go on: a complete run is skipped, a run with a checkpoint in its folder "
    "(train.checkpoint_every > 0) resumes from it, any other starts over"
)


def interrupted_line(stop: KeyboardInterrupt, how: str) -> str:
    """``interrupted (Ctrl-C): <how>``; a simulated kill (``train.stop_after``) says so instead of Ctrl-C."""
    return f"interrupted ({str(stop) or 'Ctrl-C'}): {how}"


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from dp_adam_bench.engine.checkpoint import CheckpointError
    from dp_adam_bench.placement import claim_gpu, skip_locked_run

    claim_gpu()  # a worker of a GPU sweep takes its GPU before anything touches CUDA; elsewhere a no-op

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    for line in ignored_overrides(cfg, overrides):
        print(line, file=sys.stderr)
    note = default_sampler_note(cfg, overrides)
    if note:
        print(note, file=sys.stderr)
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
    except PrivacyMismatch as err:
        print(f"privacy error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
