"""The parts of the GPU check, in the order they run (``PARTS``), and the checks that run in-process as
subcommands of ``gpu_check.py`` (``SUBCOMMANDS``)."""

from __future__ import annotations

from . import benches, ddp, paper_runs, suite, sweep
from .bf16_grid import cmd_grid
from .commands import subcommand, verify_json, verify_runs
from .ddp import cmd_nccl
from .environment import cmd_env
from .part import Ctx, Part
from .tf32 import cmd_tf32

SUBCOMMANDS = {"env": cmd_env, "tf32": cmd_tf32, "grid": cmd_grid, "nccl": cmd_nccl}


def in_process(sub: str):
    """The commands of a part that is one in-process check: ``gpu_check.py SUB``."""

    def commands(ctx: Ctx) -> list[list[str]]:
        return [subcommand(ctx, sub)]

    return commands


PARTS = [
    Part("env", "device, versions, fp32 math", 60, in_process("env"), verify_json("env.json")),
    Part(
        "suite",
        "make test's tier of the suite on this device (pytest -n -m 'not slow')",
        200,
        suite.suite_commands,
        suite.verify_junit("suite.xml"),
    ),
    Part(
        "bench_gpu",
        "bench_gpu.py: every row and mode, fp32 and bf16",
        150,
        benches.bench_commands,
        benches.verify_bench,
    ),
    Part(
        "tf32_conv",
        "TF32 on: clipped contributions' norms <= C (CNN5, bk / ghost / hooks)",
        60,
        in_process("tf32"),
        verify_json("tf32.json"),
    ),
    Part(
        "grid_bf16",
        "conformance cases through bk under bf16 autocast; self-check on the benchmark models",
        90,
        in_process("grid"),
        verify_json("grid.json"),
    ),
    Part(
        "conformance",
        "conformance grid fp32 / fp64 (tests/test_conformance.py)",
        90,
        suite.conformance_commands,
        suite.verify_junit("conformance.xml", "test_conformance"),
    ),
    Part(
        "paper_cifar10",
        "paper profile of each CIFAR-10 table, a few dozen steps",
        120,
        paper_runs.paper_commands,
        verify_runs(paper_runs.paper_experiments),
    ),
    Part(
        "pretrain",
        "pretraining gpt2_arxiv for a few steps",
        90,
        paper_runs.pretrain_commands,
        paper_runs.verify_pretrain,
    ),
    Part(
        "ddp_nccl",
        "NCCL on one GPU (1 rank; gloo on a CPU), torchrun 1 process",
        90,
        ddp.ddp_nccl_commands,
        ddp.verify_nccl,
    ),
    Part(
        "ddp_gloo",
        "data-parallel on the CPU, gloo, 2 ranks",
        90,
        ddp.ddp_gloo_commands,
        verify_runs(lambda c: ["gpu_check_gloo2"], world=2),
    ),
    Part(
        "sweep_jobs",
        "sweep --jobs 2 placing two workers on the GPU",
        120,
        sweep.sweep_commands,
        sweep.verify_sweep,
    ),
    Part(
        "suite_slow",
        "make test-slow's tier on this device (pytest -n -m slow: the paper smokes, killed and resumed runs)",
        240,
        suite.suite_slow_commands,
        suite.verify_junit("suite_slow.xml"),
    ),
]
