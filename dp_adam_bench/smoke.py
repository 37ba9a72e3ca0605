"""``dp-adam-bench sweep <experiment> --profile paper --smoke``: every run of a preset, 2 steps each, through the
same code a full run takes, then the preset's reports built from those runs.

What a smoke run keeps from the run it stands for: the task with its real model class, tokenizer and data loader
(the Hugging Face hub, or a warm cache of it), the sampler at the run's sampling rate, sigma calibrated (or the
steps to the target epsilon found) over the *full* schedule, the clipping engine, the noise mechanism, the
optimizer variant and the diagnostics. What it changes: it trains the first ``SMOKE_STEPS`` steps only (the
privacy plan is built for the whole run; only its ``steps`` is cut), killed after step 1 and resumed from that
checkpoint for step 2 (as any resume, it carries over the engine self-check that passed before step 1, which the
checkpoint records: :mod:`dp_adam_bench.engine.self_check`); it evaluates on ``SMOKE_TEST_EXAMPLES`` test
examples and decodes ``SMOKE_GENERATE`` of them (with the run's beam search); diagnostics are taken at every step.

When the data present are smaller than the paper's (a test cache of a few hundred rows), the batch is scaled with
them so that the privacy accounting is the paper's: Poisson sampling keeps q = B / N (B = paper B x N_here /
N_paper, an expected batch size), a single-pass schedule keeps its steps per epoch (hence its min separation,
participations and sensitivity) with a smaller batch. The paper's N comes from :mod:`dp_adam_bench.paper_plan`.

Runs go to ``<run store>/_smoke/`` and reports to ``<run store>/_smoke/results/``, never over ``results/``; each
report file says it is a smoke run. Seeds and the tuned hyperparameters of a preset's ``selection`` do not change
what code runs, so the smoke runs one point per distinct setting of everything else (the first seed, the first
value of each tuned key).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dp_adam_bench.errors import ConfigError
from dp_adam_bench.paper_plan import compose_run, paper_examples, smoke_points

log = logging.getLogger(__name__)

SMOKE_STEPS = 2
SMOKE_TEST_EXAMPLES = 8
SMOKE_GENERATE = 2
SMOKE_FOLDER = "_smoke"
BANNER = (
    "> **SMOKE RUN** — {steps} training steps per run on the data present (`dp-adam-bench sweep {experiment} "
    "--profile {profile} --smoke`): this checks that every run of the table executes; its numbers are not results.\n\n"
)


def smoke_root(runs: Path | None = None) -> Path:
    from dp_adam_bench.paths import runs_dir

    return Path(runs or runs_dir()) / SMOKE_FOLDER


def _smoke_settings(data: dict) -> dict:
    """The operational changes of a smoke run (the model, data loader, sampler and privacy plan stay)."""
    data = json.loads(json.dumps(data))
    t, task = data["train"], data["task"]
    t.update(checkpoint_every=1, log_every=1, eval_every=0, resume=True, force=False, stop_after=None)
    if (data.get("diagnostics") or {}).get("every"):
        data["diagnostics"]["every"] = 1
    if "test_subset" in task:
        task["test_subset"] = min(int(task["test_subset"] or SMOKE_TEST_EXAMPLES), SMOKE_TEST_EXAMPLES)
    if task.get("val_subset"):  # scored beside the test examples: as few
        task["val_subset"] = min(int(task["val_subset"]), SMOKE_TEST_EXAMPLES)
    if "generate_subset" in task:
        task["generate_subset"] = SMOKE_GENERATE
    return data


_TASKS: dict[str, object] = {}  # the runs of a preset share few task configs: each is built once


def _build_task(data: dict):
    from dp_adam_bench.tasks.registry import build_task

    key = json.dumps([data["task"], data["seed"]], sort_keys=True, default=str)
    if key not in _TASKS:
        cfg = OmegaConf.create(data)
        _TASKS[key] = build_task(cfg.task, trials=int(cfg.task.get("trials", 1)), seed=int(cfg.seed))
    return _TASKS[key]


#: samplers whose accounting depends on the sampling rate B / N, kept by scaling the expected batch
RATE_SAMPLERS = ("poisson", "cyclic_poisson")


def fit_to_data(data: dict) -> tuple[dict, object, str | None]:
    """(config, task, note): the task built from the run config; when the data present are smaller than the
    paper's, the batch (and a single-pass subset) scaled so that the accounting stays the paper's."""

    n_paper = paper_examples(data)
    t = data["train"]
    try:
        task = _build_task(data)
        n = task.dataset_size
        if (
            n_paper is None
            or n >= n_paper
            or float(t["batch_size"]) <= n
            and t["sampler"] not in RATE_SAMPLERS
        ):
            return data, task, None
    except ValueError as err:  # a train_subset larger than the data here
        if "train_subset" not in str(err) or n_paper is None:
            raise
        data = json.loads(json.dumps(data))
        data["task"]["train_subset"] = None
        task = _build_task(data)
        n = task.dataset_size
    data = json.loads(json.dumps(data))
    b = float(t["batch_size"])
    if t["sampler"] in RATE_SAMPLERS:  # q = B / N (cyclic Poisson: b B / N, b unchanged)
        data["train"]["batch_size"] = b * n / n_paper
        note = (
            f"{t['sampler']}: B / N = {b:g} / {n_paper} kept: expected batch {b * n / n_paper:.4g} of the {n} "
            "examples here"
        )
        if data["task"].get("train_subset") is not None:
            data["task"]["train_subset"] = None
            task = _build_task(data)
        return data, task, note
    per_epoch = n_paper // int(b)
    if n < per_epoch:
        raise ConfigError(
            f"smoke: {n} training examples here, fewer than the {per_epoch} steps per epoch of the single-pass "
            f"schedule (N = {n_paper}, B = {int(b)}): the accounting cannot be the paper's"
        )
    b_here = n // per_epoch
    data["train"]["batch_size"] = b_here
    data["task"]["train_subset"] = per_epoch * b_here
    note = f"single pass: {per_epoch} steps per epoch kept with batch {b_here} (paper: {int(b)} of {n_paper})"
    return data, _build_task(data), note


def smoke_run(data: dict, root: Path, steps: int = SMOKE_STEPS, done: set | None = None) -> Path:
    """Train one run for ``steps`` steps (killed after step 1, resumed from its checkpoint), with the privacy plan
    of the whole run; returns its folder, whose ``summary.json`` carries a ``smoke`` entry. A folder already in
    ``done`` (two sweep points that are the same run, e.g. a grid value equal to the default) is not run again;
    any other earlier smoke folder of the run is replaced."""
    from dp_adam_bench.config import validate
    from dp_adam_bench.engine import checkpoint as ckpt
    from dp_adam_bench.engine import trainer
    from dp_adam_bench.tracking.run_store import RunFolder, run_id

    data = _smoke_settings(data)
    validate(data)
    data, task, note = fit_to_data(data)
    validate(data)
    name = data["experiment_name"]
    path = RunFolder.folder(root, name, run_id(data))
    if done is not None and path in done:
        return path
    shutil.rmtree(path, ignore_errors=True)
    if done is not None:
        done.add(path)

    def prepared(stop_after):
        cfg = OmegaConf.create({**data, "train": {**data["train"], "stop_after": stop_after}})
        torch.manual_seed(int(cfg.seed))
        run = trainer.prepare(cfg, task, folder.path)
        return cfg, dataclasses.replace(
            run, plan=dataclasses.replace(run.plan, steps=min(steps, run.plan.steps))
        )

    folder = RunFolder.create(root, name, data)
    try:
        cfg, run = prepared(1 if steps > 1 else None)
        if steps > 1:
            try:
                trainer.run(cfg, folder.path, folder.log, prepared=run)
                raise RuntimeError("smoke: the run was not interrupted after step 1")
            except KeyboardInterrupt:
                pass  # the simulated kill
            if not (folder.path / ckpt.FILENAME).is_file():
                raise RuntimeError(f"smoke: no checkpoint in {folder.path} after step 1")
            cfg, run = prepared(None)
        planned = run.plan
        result = trainer.run(cfg, folder.path, folder.log, prepared=run)
    except BaseException:
        folder.close()
        raise
    # The kill-and-resume above has used the checkpoint; a finished 2-step smoke run is never extended, and a
    # paper-scale checkpoint is large (BandMF keeps its last b noise vectors: 4.3 GB for the paper's BERT-tiny at
    # b = 128), so the smoke records its size (what a full run will write) and deletes it.
    checkpoint = folder.path / ckpt.FILENAME
    checkpoint_bytes = checkpoint.stat().st_size if checkpoint.is_file() else None
    checkpoint.unlink(missing_ok=True)
    result["smoke"] = {
        "checkpoint_bytes": checkpoint_bytes,
        "steps": result["steps"],
        "planned_steps": planned.sampler.steps,
        "sigma": planned.sigma,
        "calibrated": planned.calibrated,
        "batch_size": data["train"]["batch_size"],
        "scaled": note,
        "resumed_from_step": 1 if steps > 1 else None,
    }
    folder.write_json("ledger.json", result["ledger"])
    folder.finish(result, seed=int(data["seed"]), device=run.backend.device)
    return folder.path


def _mark(path: Path, experiment: str, profile: str) -> None:
    if path.suffix == ".md":
        path.write_text(
            BANNER.format(steps=SMOKE_STEPS, experiment=experiment, profile=profile) + path.read_text()
        )


def run_smoke(experiment: str, profile: str = "paper", overrides=(), runs: Path | None = None) -> int:
    """Smoke-run every run of ``experiment`` (see the module docstring), then build its reports from them."""
    from dp_adam_bench.report import registry
    from dp_adam_bench.report.context import ReportContext

    root = smoke_root(runs)
    points = smoke_points(experiment, profile)
    t0 = time.time()
    done: set = set()
    for i, point in enumerate(points, 1):
        data = compose_run(experiment, profile, point, overrides)
        path = smoke_run(data, root, done=done)
        summary = json.loads((path / "summary.json").read_text())
        sm = summary["smoke"]
        eps = ", ".join(f"{k} {v:.3g}" for k, v in (summary.get("epsilon") or {}).items() if v is not None)
        print(
            f"smoke {i}/{len(points)} {path.name}: {sm['steps']} of {sm['planned_steps']} steps, sigma "
            f"{sm['sigma']:.4g}{' (calibrated)' if sm['calibrated'] else ''}, batch {sm['batch_size']:.4g}"
            + (f", epsilon in the ledger: {eps}" if eps else "")
            + (f", checkpoint {sm['checkpoint_bytes'] / 2**20:.0f} MiB" if sm.get("checkpoint_bytes") else "")
            + (f" [{sm['scaled']}]" if sm["scaled"] else ""),
            flush=True,
        )
    ctx = ReportContext(profile=profile, out=root / "results", runs=root)
    for tid in registry.GROUPS["all"]:
        if registry.spec(tid).experiment == experiment:
            for path in registry.build(tid, ctx):
                _mark(Path(path), experiment, profile)
                print(f"wrote {path} (smoke)")
    print(f"smoke of {experiment} ({profile}): {len(points)} runs in {time.time() - t0:.0f} s", flush=True)
    return 0
