"""Command lines and checks that several parts share: a training run, a run of one of ``gpu_check.py``'s
in-process checks, and the summaries the runs leave."""

from __future__ import annotations

import json
from collections.abc import Callable

from .part import Ctx, PartFailed
from .paths import ENTRY

#: a private CIFAR-10 run's sizes under --quick
QUICK_SIZE = ["train.batch_size=32", "train.physical_batch_size=16", "task.train_subset=256"]


def train(ctx: Ctx, *overrides: str) -> list[str]:
    return [ctx.py, "-m", "dp_adam_bench.train", *overrides, "logger.wandb.mode=disabled"]


def cifar_small(ctx: Ctx, name: str) -> list[str]:
    """A short private CIFAR-10 CNN5 run (the data-parallel and torchrun parts)."""
    size = QUICK_SIZE
    if not ctx.quick:
        size = ["train.batch_size=256", "train.physical_batch_size=128", "task.train_subset=4096"]
    return [
        "task=cifar10_cnn",
        "optimizer=adam",
        "optimizer.lr=0.001",
        "noise=independent",
        "privacy.sigma=1.0",
        "privacy.clip=1.0",
        "train.sampler=poisson",
        "train.steps=4",
        "task.test_subset=200",
        *size,
        f"experiment_name={name}",
    ]


def summaries(ctx: Ctx, experiment: str) -> list[dict]:
    root = ctx.work / "runs" / experiment
    return [json.loads(p.read_text()) for p in sorted(root.glob("*/summary.json"))] if root.is_dir() else []


def subcommand(ctx: Ctx, sub: str) -> list[str]:
    """``gpu_check.py SUB``: one in-process check (``registry.SUBCOMMANDS``), its result in ``SUB.json``."""
    quick = ["--quick"] if ctx.quick else []
    return [ctx.py, str(ENTRY), sub, "--device", ctx.device, *quick, "--out", str(ctx.out / f"{sub}.json")]


def verify_json(name: str, key: str = "ok") -> Callable[[Ctx, str], str]:
    def verify(ctx: Ctx, log: str) -> str:
        path = ctx.out / name
        if not path.is_file():
            raise PartFailed(f"no {name} written")
        got = json.loads(path.read_text())
        if not got.get(key):
            raise PartFailed(got.get("summary", "failed"))
        return got.get("summary", "")

    return verify


def verify_runs(experiments: Callable[[Ctx], list[str]], world: int = 1) -> Callable[[Ctx, str], str]:
    def verify(ctx: Ctx, log: str) -> str:
        lines = []
        for exp in experiments(ctx):
            found = summaries(ctx, exp)
            if not found:
                raise PartFailed(f"{exp}: no run summary")
            for s in found:
                check = s.get("self_check") or {}
                lines.append(
                    f"{exp}: {s['steps']} steps, {s.get('clipping')}, world {s.get('world_size')}, "
                    f"test_accuracy {s['metrics'].get('test_accuracy', float('nan')):.1f}, self-check "
                    f"{check.get('max_rel_error', float('nan')):.2g}"
                )
                if s.get("world_size") != world or s["steps"] < 1:
                    raise PartFailed(f"{lines[-1]}: want world {world}")
        return "; ".join(lines)

    return verify
