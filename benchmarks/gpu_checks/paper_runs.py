"""The ``paper_cifar10`` and ``pretrain`` parts: a short paper-profile run of each CIFAR-10 table (B = 2048, ghost
clipping, a few dozen steps, the run's self-check and summary), and pretraining ``gpt2_arxiv`` for a few steps."""

from __future__ import annotations

import json

from .commands import QUICK_SIZE, train
from .part import Ctx, PartFailed
from .paths import TESTS

PAPER_TABLES = ("tang_fig1_cifar10", "tang_fig3_cifar10")


def paper_experiments(ctx: Ctx) -> list[str]:
    return [f"gpu_check_{table}" for table in PAPER_TABLES]


def paper_commands(ctx: Ctx) -> list[list[str]]:
    steps = 2 if ctx.quick else 30
    # the paper's B = 2048 in micro-batches of 512
    size = [*QUICK_SIZE, "task.test_subset=200"] if ctx.quick else ["task.test_subset=2000"]
    return [
        train(
            ctx,
            f"experiment={table}",
            "profile=paper",
            "optimizer=adambc",
            "optimizer.lr=0.001",
            "privacy.target_epsilon=null",
            f"train.steps={steps}",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            f"train.device={ctx.device}",
            *size,
            f"experiment_name=gpu_check_{table}",
        )
        for table in PAPER_TABLES
    ]


def pretrain_commands(ctx: Ctx) -> list[list[str]]:
    over = {
        "steps": 6,
        "warmup_steps": 1,
        "eval_every": 0,
        "checkpoint_every": 0,
        "log_every": 2,
        "val_blocks": 4,
    }
    if ctx.quick:
        over |= {
            "n_layer": 1,
            "n_embd": 16,
            "n_head": 2,
            "n_positions": 64,
            "block_size": 16,
            "batch_size": 4,
        }
        over["data_dir"] = str(ctx.work / "abstracts.jsonl.gz")
    over |= {"device": ctx.device, "wandb": {"mode": "disabled"}}
    args = [f"{k}={json.dumps(v)}" for k, v in over.items()]
    cmds = [[ctx.py, "-m", "dp_adam_bench.cli", "pretrain", "gpt2_arxiv", *args]]
    if ctx.quick:  # 300 abstracts, not 19,834: the tokenizer's time
        make = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from helpers import first_abstracts; "
        make += f"first_abstracts({over['data_dir']!r}, 300)"
        cmds.insert(0, [ctx.py, "-c", make])
    return cmds


def verify_pretrain(ctx: Ctx, log: str) -> str:
    found = sorted((ctx.work / "cache").rglob("summary.json"))
    if not found:
        raise PartFailed("no pretraining summary")
    s = json.loads(found[-1].read_text())
    dev = s.get("provenance", {}).get("device")
    line = f"gpt2_arxiv on {dev}: val_loss {s.get('val_loss', float('nan')):.3f}"
    if not str(dev).startswith(ctx.device):
        raise PartFailed(f"{line}; want {ctx.device}")
    return line
