"""The GPU benchmark (``bench_gpu.py``, ``make bench-gpu``): issue 26's GPU targets and the README section.

``results_gpu.csv`` is written only by a real run on a CUDA machine, so usually it does not exist; the section
then says what the benchmark measures and how to run it. Ours are bk and ghost; Opacus ghost and Opacus hooks are
the comparison, not the targets' subject (bk has to beat the faster of them).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .provenance import provenance_line
from .registry import Bench
from .tables import factor_verdict, markdown_table, quick_prefix, ratio_cell

#: issue 26's GPU targets: each DP mode of ours / non-private, in median step time and in peak GPU memory
GPU_MAX = 1.3
GPU_GOAL = 1.1  # the goal, for the worse of the two ratios
OURS = ("bk", "ghost")
OPACUS = ("opacus_ghost", "opacus_hooks")
COMMAND = "make bench-gpu"  # = python benchmarks/bench_gpu.py --device cuda

TARGETS = (
    f"Issue 26's GPU targets, per (model, B, precision): each DP mode of ours (bk, ghost) <= {GPU_MAX}x the "
    f"non-private step in median step time and in peak GPU memory; bk faster than the faster of Opacus ghost and "
    f"Opacus hooks; the goal is {GPU_GOAL}x (for the worse of time and memory)."
)


#: how to run the one-command GPU check (benchmarks/gpu_check.py, issue 34) on a lent machine, and what it writes
GPU_CHECK = [
    "### GPU check: everything a GPU user leans on, in one command (`make gpu-check`)",
    "",
    "`benchmarks/gpu_check.py` runs, on one GPU in at most 8 minutes (`--budget`, default 450 s, plus the "
    "wheels' install), each part in its own process with its own time limit, and writes its result as soon as the "
    "part ends, so a part that fails or hangs loses nothing else: the test suite on CUDA (`pytest -n <cores>`, "
    "pass / fail counts), this benchmark (every row and mode, fp32 and bf16, into `results_gpu.csv`), the TF32 "
    "check on cuDNN convolutions (each clipped contribution's norm <= C, with the engines' IEEE guard off as the "
    "control), the conformance cases through bk under bf16 and the self-check on CNN5 / BERT-base / GPT-2 small, "
    "the fp32 conformance grid, a paper-profile run of each CIFAR-10 table (30 steps), pretraining for 6 steps, "
    "NCCL on one GPU, gloo with 2 ranks, and `sweep --jobs 2` placing two workers on the GPU. It writes "
    "`benchmarks/gpu_check/report.md` (one row per part: status, seconds, a one-line result) and the raw files "
    "beside it (`results.json`, each part's log, the JUnit XML, the checks' JSON, `bench_gpu.csv`).",
    "",
    "On a lent GPU machine (no network, torch with CUDA installed): prepare here once with "
    "`bash ../shared/gpu/prepare_device.sh` (wheels in `.whl/`, data and `on_device.sh` in `.gpudata/`), send "
    "`.whl` and `.gpudata` along, and run there, from the repository's root:",
    "",
    "```bash",
    "bash .gpudata/on_device.sh python3 benchmarks/gpu_check.py --device cuda   # = make gpu-check",
    "bash .gpudata/on_device.sh python3 benchmarks/gpu_check.py --device cuda --parts suite   # a part again",
    "```",
    "",
    "Then commit `benchmarks/gpu_check/` and `benchmarks/results_gpu.csv` and run "
    "`python benchmarks/run_all.py --readme-only`. On a machine without a GPU, "
    "`python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gc` (`make gpu-check-cpu`) runs the same "
    "commands at tiny sizes (NCCL's part as gloo, the sweep as a dry run; about 90 s on 2 cores); a CPU run "
    "refuses to write `benchmarks/gpu_check/` or `results_gpu.csv` (`tests/test_gpu_check.py`).",
    "",
]


def section(bench_dir: Path, bench: Bench, prov: dict, df: pd.DataFrame | None) -> list[str]:
    """The README section of the GPU benchmark: its CSV, ratio table and verdicts, or how to produce them; then
    how to run the GPU check."""
    lines = [f"## {bench.title}: `{bench.csv}`", ""]
    if df is None:
        return lines + [
            f"No GPU run is recorded yet. `{bench.script}` measures the {bench.what}. It runs only on a CUDA "
            f"machine and is not part of `make bench`: `{COMMAND}` (`python benchmarks/{bench.script} --device "
            f"cuda`) writes `{bench.csv}`, then `python benchmarks/run_all.py --readme-only` puts it here. "
            + TARGETS,
            "",
            *GPU_CHECK,
        ]
    lines += [
        provenance_line(bench_dir, bench.csv, prov, df, COMMAND),
        "",
        f"What it measures: {bench.what}.",
        "",
    ]
    caption, table = markdown_table(df)
    if caption:
        lines += [caption, ""]
    lines += [table, ""]
    lines += [
        TARGETS + " Each cell is DP / non-private at the same (model, B, precision): median step time / peak "
        "memory. 'MISSED xF' gives the miss factor F = measured / target.",
        "",
    ]
    return lines + ratio_table(df) + GPU_CHECK


def _last(g: pd.DataFrame, mode: str) -> pd.Series | None:
    """The last row of ``mode`` in the group (a re-run appended later wins), or None."""
    found = g[g["mode"] == mode]
    return None if found.empty else found.iloc[-1]


def _ours(found: dict[str, pd.Series | None], value, limit: float) -> str:
    """'bk: met (...); ghost: MISSED ...' for ``value(row)`` of each of our modes against ``limit``."""
    return "; ".join(
        f"{m}: " + ("not measured" if found[m] is None else factor_verdict(value(found[m]), limit))
        for m in OURS
    )


def _worse(r: pd.Series) -> float:
    """The larger of the time and memory ratios (NaN when either is missing)."""
    t, m = r.ratio_to_nonprivate, r.ratio_mem_to_nonprivate
    return float("nan") if t != t or m != m else max(t, m)


def _bk_vs_opacus(found: dict[str, pd.Series | None]) -> str:
    bk = found["bk"]
    if bk is None or bk.median_step_ms != bk.median_step_ms:
        return "not measured"
    opacus = [
        found[m]
        for m in OPACUS
        if found[m] is not None and found[m].median_step_ms == found[m].median_step_ms
    ]
    if not opacus:
        return "no Opacus row"
    best = min(opacus, key=lambda r: r.median_step_ms)
    times = f"bk {bk.median_step_ms:.1f} ms vs {best['mode']} {best.median_step_ms:.1f} ms"
    if bk.median_step_ms < best.median_step_ms:
        return f"met ({times})"
    return f"MISSED x{bk.median_step_ms / best.median_step_ms:.2f} ({times})"


def ratio_table(df: pd.DataFrame) -> list[str]:
    """One row per (model, B, micro-batch, precision): each mode's ratios to non-private, and the verdicts of
    issue 26."""
    modes = [m for m in (*OURS, *OPACUS) if (df["mode"] == m).any()]
    modes += sorted(set(df["mode"].astype(str)) - {"nonprivate", *modes})
    head = (
        ["model", "B", "micro-batch", "precision", "non-private ms/step, GiB"]
        + [f"{m} x time / x mem" for m in modes]
        + [f"time <= {GPU_MAX}x", f"memory <= {GPU_MAX}x", "bk faster than Opacus", f"goal <= {GPU_GOAL}x"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (model, b, phys, precision), g in df.groupby(
        ["model", "batch_size", "physical_batch_size", "precision"], sort=False, dropna=False
    ):
        found = {m: _last(g, m) for m in ("nonprivate", *modes, *OURS, *OPACUS)}
        base = found["nonprivate"]
        np_cell = "" if base is None else f"{base.median_step_ms:.1f} ms, {base.peak_mem_gib:.2f} GiB"
        cells = [
            str(model),
            str(int(b)),
            "whole" if phys == b else str(int(phys)),
            str(precision),
            np_cell,
        ] + [ratio_cell(found[m], "median_step_ms") for m in modes]
        quick = quick_prefix(base) if base is not None else ""
        cells += [
            quick + _ours(found, lambda r: r.ratio_to_nonprivate, GPU_MAX),
            quick + _ours(found, lambda r: r.ratio_mem_to_nonprivate, GPU_MAX),
            quick + _bk_vs_opacus(found),
            quick + _ours(found, _worse, GPU_GOAL),
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines + [""]
