"""The ``sweep_jobs`` part: ``dp-adam-bench sweep --jobs 2`` placing two joblib workers on the one GPU (their slot
files and every run's summary are checked); under --quick the sweep's ``--dry-run``."""

from __future__ import annotations

from .commands import summaries
from .part import Ctx, PartFailed

SWEEP_OVER = ["train.steps=3", "task.test_subset=500", "train.eval_every=0", "train.checkpoint_every=0"]


def sweep_commands(ctx: Ctx) -> list[list[str]]:
    cmd = [ctx.py, "-m", "dp_adam_bench", "sweep", "tang_fig1_cifar10", "--profile", "cpu", "--jobs", "2"]
    return [cmd + SWEEP_OVER + (["--dry-run"] if ctx.quick else [])]


def verify_sweep(ctx: Ctx, log: str) -> str:
    if ctx.quick:  # the dry run: the commands the sweep would launch
        launches = [ln for ln in log.splitlines() if ln.startswith("+ ") and "hydra.launcher.n_jobs=2" in ln]
        if not launches:
            raise PartFailed("the dry run printed no joblib command with 2 workers")
        return f"dry run: {len(launches)} multirun commands with 2 joblib workers"
    slots = sorted((ctx.work / "slots").glob("gpu*.lock"))
    pids = {p.read_text().strip() for p in slots}
    runs = summaries(ctx, "tang_fig1_cifar10_cpu")
    line = f"{len(runs)} runs complete; GPU slots {[p.name for p in slots]} held by {len(pids)} worker(s)"
    if len(slots) != 2 or len(pids) != 2 or len(runs) != 9:
        raise PartFailed(f"{line}; want 9 runs and 2 slots on GPU 0 held by 2 workers")
    return line
