"""GPU proof in one command (issue 34): what a GPU user leans on, checked on one lent GPU in at most 8 minutes.

    python benchmarks/gpu_check.py --device cuda                    # = make gpu-check; writes benchmarks/gpu_check/
    python benchmarks/gpu_check.py --device cuda --parts suite bench_gpu   # only these parts
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gc      # the same code paths on a CPU, tiny sizes

Each part runs in its own process with its own time limit, and its result (passed / FAILED / TIMED OUT / skipped,
seconds, a one-line summary and its log) is written to ``report.md`` and ``results.json`` as soon as it ends, so a
part that fails or hangs, or the whole command being killed, loses nothing measured before. The parts, in order
(``PARTS``):

* ``env``: device, driver, torch / CUDA / cuDNN / NCCL / Opacus versions, the fp32 math settings, cores, xdist;
* ``suite``: ``make test``'s tier of the test suite on this device (``pytest -n <cores> -m "not slow"``,
  pytest-xdist), pass / fail counts from its JUnit XML (``suite.xml``) and the failing tests' names;
* ``bench_gpu``: ``bench_gpu.py``, every row and mode in fp32 and bf16, rows appended as measured (CUDA:
  ``benchmarks/results_gpu.csv``; a CPU run never writes that file);
* ``tf32_conv``: TF32 on (cuDNN convolutions and CUDA matmuls, as a user may set it), CNN5 through bk, ghost and
  hooks one example at a time with every example clipped: each clipped contribution's norm must be <= C up to
  fp32 rounding; the same with the engines' IEEE guard (``engine/fp32_exact.py``) switched off is reported as the
  control, which shows whether TF32 would have broken the bound on this card;
* ``grid_bf16``: the conformance grid's layer cases through bk (auto, Gram, instantiate) under bf16 autocast, and
  the engine self-check on the benchmark models (CNN5, BERT-base, GPT-2 small) in fp32 and bf16;
* ``conformance``: the fp32 / fp64 conformance grid (``tests/test_conformance.py``) on this device: its counts
  read from the suite's JUnit XML when the suite ran it, else its own pytest run;
* ``paper_cifar10``: a short paper-profile run of each CIFAR-10 table (B = 2048, ghost clipping, a few dozen
  steps, the run's self-check and summary);
* ``pretrain``: pretraining ``gpt2_arxiv`` on this device for a few steps;
* ``ddp_nccl``: NCCL collectives of the library's data-parallel context on one GPU (one rank: ``WORLD_SIZE=1``
  takes the single-process path in training, so the process group is made here and its collectives forced on;
  gloo on a CPU), then a training run launched by ``torchrun --nproc_per_node=1`` on the GPU;
* ``ddp_gloo``: data-parallel training on the CPU with gloo, 2 ranks (the fallback when ranks outnumber GPUs);
* ``sweep_jobs``: ``dp-adam-bench sweep --jobs 2`` placing two joblib workers on the one GPU (their slot files
  and every run's summary are checked);
* ``suite_slow``: ``make test-slow``'s tier (``-m slow``: every paper table's smoke, killed and resumed runs),
  last, so that the default budget usually leaves it for a call of its own (``--parts suite_slow``).

``--budget`` (seconds, default 450) bounds the whole: a part starts only with at least ``MIN_PART_S`` left and
runs at most min(its limit, what is left); the parts not started are reported as skipped for time, to run next
with ``--parts`` (which keeps the other parts' results in the report folder). At its limit a part gets SIGINT
(pytest then writes the JUnit XML of the tests it ran), then SIGKILL ``GRACE_S`` later. Without CUDA a part marked
``cuda_only`` is reported as "skipped: no CUDA" (none is: on a CPU, NCCL's part runs gloo); ``--quick`` shrinks
the sizes (tiny models, a few steps, one test file for the suite) and runs the sweep as ``--dry-run``. Every part
at quick sizes took about 90 s on 2 CPU cores.

This file is the entry point: its options, and the in-process checks' subcommands. The parts are in
``gpu_checks/`` (one module per family of parts, the runner, the report; see its ``__init__``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gpu_checks.part import Ctx
from gpu_checks.paths import OUT, REPO_ROOT
from gpu_checks.registry import PARTS, SUBCOMMANDS
from gpu_checks.report import header
from gpu_checks.runner import MIN_PART_S, run_parts

BUDGET_S = 450  # 7.5 min: with the wheels' install (~30 s) inside the 8 minutes of issue 34


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return _subcommand(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    _refuse(parser, args)
    earlier = _report_folder(args.out, rerun=args.parts is not None)
    ctx = _context(args)
    parts = [p for p in PARTS if args.parts is None or p.name in args.parts]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results = run_parts(
        parts, ctx, args.budget, header(ctx, argv, args.budget, started) | {"earlier": earlier}
    )
    failed = [r.name for r in results if r.status in ("FAILED", "TIMED OUT")]
    print(f"[gpu-check] report: {ctx.out / 'report.md'}; {len(failed)} part(s) failed: {failed}", flush=True)
    return 1 if failed else 0


def _subcommand(argv: list[str]) -> int:
    """One in-process check (``gpu_check.py SUB --device D [--quick] --out SUB.json``), run by its part."""
    parser = argparse.ArgumentParser(prog=f"gpu_check.py {argv[0]}")
    parser.add_argument("--device", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv[1:])
    got = SUBCOMMANDS[argv[0]](args)
    args.out.write_text(json.dumps(got, indent=1, default=str))
    print(got["summary"], flush=True)
    return 0 if got["ok"] else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", required=True, choices=("cuda", "cpu"), help="cuda, or cpu to prove it")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, one test file, the sweep as --dry-run"
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"the report folder (default {OUT})")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all the parts together")
    parser.add_argument("--parts", nargs="+", choices=[p.name for p in PARTS], default=None)
    parser.add_argument("--cores", type=int, default=None, help="pytest -n (default: every core)")
    return parser


def _refuse(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop at a CUDA run without CUDA, a CPU run aimed at the committed report folder, a budget too small."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: torch {torch.__version__} sees no CUDA GPU here; use --device cpu --quick"
        )
    if args.device != "cuda" and args.out.resolve() == OUT.resolve():
        parser.error(
            f"--device {args.device} writes {OUT.relative_to(REPO_ROOT)} only from a CUDA run; pass --out"
        )
    if args.budget < MIN_PART_S:
        parser.error(f"--budget {args.budget:g}: need at least {MIN_PART_S} s")


def _report_folder(out: Path, rerun: bool) -> list[dict]:
    """An empty report folder, or for a rerun of some parts (``--parts``) the folder as it is and the earlier
    run's results, kept for the other parts."""
    earlier = []
    if rerun and (out / "results.json").is_file():
        earlier = json.loads((out / "results.json").read_text()).get("parts", [])
    elif out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return earlier


def _context(args: argparse.Namespace) -> Ctx:
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    return Ctx(
        args.device,
        args.quick,
        args.out.resolve(),
        work.resolve(),
        args.cores or os.cpu_count() or 1,
        _has_xdist(),
    )


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
