"""One folder per run, readable without W&B.

Layout of ``runs/<experiment>/<run_id>/``:

* ``config.yaml`` — the resolved config the run used;
* ``metrics.jsonl`` — one JSON object per logged step (``{"step": t, ...}``);
* ``ledger.json`` — the privacy ledger;
* ``summary.json`` — written last, with ``status: complete``, final metrics, wall time, git commit, seed.

A folder without ``summary.json`` (or whose status is not ``complete``) is an incomplete run: the report lists it
and leaves it out of every table.

Run ids are deterministic (a readable prefix plus a hash of the config), so a relaunched sweep finds its own
folders and skips complete runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from dp_adam_bench.paths import REPO_ROOT

IDENTITY_KEYS = (
    "task",
    "optimizer",
    "noise",
    "privacy",
    "train",
    "diagnostics",
    "seed",
    "experiment_name",
    "profile",
)
# train.* keys that change how a run is operated, not what it computes: relaunching with other values must find
# (and resume or skip) the same run folder
OPERATIONAL_TRAIN_KEYS = (
    "force",
    "threads",
    "stop_after",
    "resume",
    "checkpoint_every",
    "log_every",
    "eval_every",
    "eval_at_start",
    "distributed",  # data-parallel or not, the same result up to float summation order
)


def run_identity(cfg: dict) -> dict:
    """The part of a config that determines a run's result."""
    ident = {k: cfg.get(k) for k in IDENTITY_KEYS}
    ident["train"] = {k: v for k, v in (cfg.get("train") or {}).items() if k not in OPERATIONAL_TRAIN_KEYS}
    return ident


def identity_hash(cfg: dict) -> str:
    return hashlib.sha1(json.dumps(run_identity(cfg), sort_keys=True, default=str).encode()).hexdigest()


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_id(cfg: dict) -> str:
    """Readable, deterministic id: ``<optimizer>-<noise>-lr<lr>-s<seed>-<hash of the identity keys>``."""
    digest = identity_hash(cfg)[:8]
    opt = cfg.get("optimizer", {}) or {}
    noise = cfg.get("noise", {}) or {}
    lr = opt.get("lr")
    lr_part = f"lr{lr:g}" if isinstance(lr, (int, float)) else "lrna"
    return f"{opt.get('name', 'opt')}-{noise.get('kind', 'noise')}-{lr_part}-s{cfg.get('seed', 0)}-{digest}"


def _clean(obj):
    """JSON-safe: tensors/arrays to lists, NaN/inf to None."""
    if hasattr(obj, "tolist"):
        obj = obj.tolist()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


class RunFolder:
    """Writer for one run folder."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.start = time.time()

    @classmethod
    def create(cls, root: Path, experiment: str, cfg: dict) -> RunFolder:
        path = Path(root) / experiment / run_id(cfg)
        path.mkdir(parents=True, exist_ok=True)
        folder = cls(path)
        # metrics.jsonl is kept: a resumed run truncates it to its checkpoint; a fresh start removes it
        (path / "summary.json").unlink(missing_ok=True)
        with open(path / "config.yaml", "w") as fh:
            yaml.safe_dump(cfg, fh, sort_keys=False)
        return folder

    def log(self, step: int, metrics: dict) -> None:
        with open(self.path / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(_clean({"step": step, **metrics})) + "\n")

    def write_json(self, name: str, payload: dict) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(_clean(payload), indent=2))
        tmp.replace(self.path / name)

    def finish(self, summary: dict, seed: int) -> dict:
        payload = {
            "status": "complete",
            "wall_time_s": time.time() - self.start,
            "git_commit": git_commit(),
            "seed": seed,
            **summary,
        }
        self.write_json("summary.json", payload)  # last: its presence marks the run complete
        return payload


@dataclass
class RunRecord:
    """A run read back from the store."""

    path: Path
    config: dict
    summary: dict | None

    @property
    def complete(self) -> bool:
        return bool(self.summary) and self.summary.get("status") == "complete"

    def metrics(self) -> list[dict]:
        f = self.path / "metrics.jsonl"
        if not f.exists():
            return []
        return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def is_complete(path: Path) -> bool:
    f = Path(path) / "summary.json"
    if not f.exists():
        return False
    try:
        return json.loads(f.read_text()).get("status") == "complete"
    except json.JSONDecodeError:
        return False


RUN_SOURCES = ("local", "wandb", "both")
RUN_SOURCE_ENV = "DP_ADAM_BENCH_RUN_SOURCE"


def run_source() -> str:
    """Where :func:`load_runs` reads runs: ``$DP_ADAM_BENCH_RUN_SOURCE`` = ``local`` (the default: the run store,
    no network), ``wandb`` (the W&B API only) or ``both`` (the run store, completed by W&B runs it lacks)."""
    source = os.environ.get(RUN_SOURCE_ENV) or "local"
    if source not in RUN_SOURCES:
        raise ValueError(f"{RUN_SOURCE_ENV}={source!r} is not a run source; valid: {', '.join(RUN_SOURCES)}")
    return source


def load_runs(root: Path, experiment: str) -> list[RunRecord]:
    """Every run of an experiment, complete or not, from the source :func:`run_source` names.

    Reports call this one function, so switching the source switches every table at once; with ``wandb`` the
    experiment is the W&B group and the project is ``$DP_ADAM_BENCH_WANDB_PROJECT``
    (see :mod:`dp_adam_bench.tracking.wandb_source`).
    """
    source = run_source()
    if source == "local":
        return load_local_runs(root, experiment)
    from dp_adam_bench.tracking.wandb_source import WandbSourceError, load_wandb_runs, merge_records

    remote = load_wandb_runs(experiment)
    if source == "both":
        return merge_records(load_local_runs(root, experiment), remote)
    if not remote:
        from dp_adam_bench.tracking.wandb_source import default_project

        raise WandbSourceError(
            f"no W&B runs in group {experiment!r} of project {default_project()!r} "
            f"(set {RUN_SOURCE_ENV}=local to read the run store)"
        )
    return remote


def load_local_runs(root: Path, experiment: str) -> list[RunRecord]:
    """Every run folder of an experiment in the run store, complete or not."""
    base = Path(root) / experiment
    records = []
    if not base.is_dir():
        return records
    for cfg_file in sorted(base.glob("*/config.yaml")):
        folder = cfg_file.parent
        with open(cfg_file) as fh:
            cfg = yaml.safe_load(fh)
        summary = None
        if (folder / "summary.json").exists():
            try:
                summary = json.loads((folder / "summary.json").read_text())
            except json.JSONDecodeError:
                summary = None
        records.append(RunRecord(folder, cfg, summary))
    return records
