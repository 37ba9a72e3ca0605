"""Where the GPU check reads and writes."""

from __future__ import annotations

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent
TESTS = REPO_ROOT / "tests"
#: the entry point; the in-process checks run as its subcommands
ENTRY = BENCH_DIR / "gpu_check.py"
#: the committed report folder, written only by a CUDA run
OUT = BENCH_DIR / "gpu_check"
RESULTS_GPU = BENCH_DIR / "results_gpu.csv"
