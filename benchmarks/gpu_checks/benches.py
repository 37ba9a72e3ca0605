"""The ``bench_gpu`` part: ``bench_gpu.py``, every row and mode in fp32 and bf16, rows appended as measured (CUDA:
``benchmarks/results_gpu.csv``; a CPU run never writes that file)."""

from __future__ import annotations

import shutil
from pathlib import Path

from .part import Ctx, PartFailed
from .paths import BENCH_DIR, RESULTS_GPU


def bench_csv(ctx: Ctx) -> Path:
    return RESULTS_GPU if ctx.cuda else ctx.out / "bench_gpu_cpu.csv"


def bench_commands(ctx: Ctx) -> list[list[str]]:
    args = ["--precision", "fp32", "bf16", "--out", str(bench_csv(ctx))]
    if ctx.quick:
        args += ["--quick", "--rows", "cnn5_B2048_micro512", "--warmup", "0", "--steps", "1"]
    else:
        args += ["--warmup", "2", "--steps", "5"]
    return [[ctx.py, str(BENCH_DIR / "bench_gpu.py"), "--device", ctx.device, *args]]


def verify_bench(ctx: Ctx, log: str) -> str:
    import pandas as pd

    path = bench_csv(ctx)
    if not path.is_file():
        raise PartFailed(f"{path.name} not written")
    df = pd.read_csv(path)
    if ctx.cuda:
        shutil.copy(path, ctx.out / "bench_gpu.csv")
    bad = df[df["median_step_ms"].isna()]
    line = f"{len(df)} rows ({', '.join(sorted(set(df['precision'])))}), fp32 math: {df['fp32_math'].iloc[0]}"
    if len(bad):
        notes = "; ".join(
            f"{r.model} B={r.batch_size} {r['mode']} {r.precision}: {r.notes}" for _, r in bad.iterrows()
        )
        raise PartFailed(f"{line}; {len(bad)} not measured: {notes}")
    return line
