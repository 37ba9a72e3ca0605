"""End-to-end wall time of Ganesh et al.'s Fig. 2 table (1-D logistic regression, 7 (variant, mechanism) pairs x
13 learning rates, 30 vectorised trials each): the sweep (``dp-adam-bench sweep ganesh_fig2``) and the report, in a
fresh run store, as a user runs it.

Two rows: W&B disabled (the harness' own cost) and W&B offline (the default logging, about 0.65 s of
``wandb.init`` per run). ``--quick`` keeps one learning rate (7 runs) for tests.

    .venv/bin/python benchmarks/bench_fig2.py [--quick] [--out results_fig2.csv]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
OUT = BENCH_DIR / "results_fig2.csv"


def time_table(wandb_mode: str, quick: bool, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "DP_ADAM_BENCH_RUNS": str(Path(tmp) / "runs"),
            "DP_ADAM_BENCH_RESULTS": str(Path(tmp) / "results"),
            "WANDB_MODE": wandb_mode,
            "WANDB_DIR": tmp,
        }
        overrides = [f"logger.wandb.mode={wandb_mode}", f"train.threads={threads}"]
        if quick:
            overrides.append("optimizer.lr=1.0")
        py = sys.executable
        start = time.perf_counter()
        subprocess.run(
            [py, "-m", "dp_adam_bench", "sweep", "ganesh_fig2", *overrides],
            cwd=REPO_ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        sweep_s = time.perf_counter() - start
        subprocess.run(
            [py, "-m", "dp_adam_bench", "report", "ganesh_fig2"],
            cwd=REPO_ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        total = time.perf_counter() - start
        runs = len(list((Path(tmp) / "runs" / "ganesh_fig2").glob("*/summary.json")))
    return {
        "table": "ganesh_fig2",
        "wandb_mode": wandb_mode,
        "runs": runs,
        "sweep_s": sweep_s,
        "total_s": total,
        "s_per_run": sweep_s / max(runs, 1),
        "threads": threads,
        "cpu": platform.processor() or platform.machine(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    threads = int(os.environ.get("BENCH_THREADS", "2"))
    rows = [time_table(mode, args.quick, threads) for mode in ("disabled", "offline")]
    df = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print(df.to_string(index=False))


if __name__ == "__main__":
    main()
