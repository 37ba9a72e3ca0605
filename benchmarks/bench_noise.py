"""Noise generation cost per step: independent (DP-SGD), BandMF (b = 128) and BLT (4 buffers).

For a TinyBERT-sized model (d = 4.4M, Ganesh et al. §5.2) and a GPT-2-sized one (d = 124M, Li et al.): the
median wall time of ``mechanism.next()`` over ``--repeats`` steps after ``--warmup`` steps, and the peak
resident memory of a process doing only that. BandMF at 124M is not allocated: its ring of b - 1 float32 model
copies would need (b - 1) * d * 4 bytes (reported instead). Every configuration runs in its own subprocess so
that peak memory is per configuration.

    .venv/bin/python benchmarks/bench_noise.py     # writes benchmarks/results_noise.csv, prints a table
    BENCH_THREADS=1 .venv/bin/python benchmarks/bench_noise.py --repeats 7

Threads: ``torch.set_num_threads`` from ``BENCH_THREADS`` (default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(REPO_ROOT))

N_STEPS = 2000
BANDS = 128
BUFFERS = 4
SIZES = {"tinybert_4.4M": 4_400_000, "gpt2_124M": 124_000_000}
#: (mechanism, model) pairs that are run; BandMF at 124M is only sized
CONFIGS = [
    ("independent", "tinybert_4.4M"),
    ("bandmf_b128", "tinybert_4.4M"),
    ("blt_4", "tinybert_4.4M"),
    ("independent", "gpt2_124M"),
    ("blt_4", "gpt2_124M"),
]
OUT = Path(__file__).resolve().parent / "results_noise.csv"


def _threads() -> int:
    return int(os.environ.get("BENCH_THREADS", "2"))


def _mechanism(kind: str):
    from dp_adam_bench.privacy.bandmf import BandedToeplitzStrategy
    from dp_adam_bench.privacy.blt import optimize_blt
    from dp_adam_bench.privacy.mechanisms import IndependentMechanism

    if kind == "independent":
        return IndependentMechanism(), 0
    if kind == "bandmf_b128":
        return BandedToeplitzStrategy(N_STEPS, BANDS).mechanism(), BANDS - 1
    if kind == "blt_4":
        strategy = optimize_blt(N_STEPS, BUFFERS, participations=3, min_separation=N_STEPS // 3)
        return strategy.mechanism(), BUFFERS
    raise ValueError(kind)


def run_one(kind: str, model: str, warmup: int, repeats: int) -> dict:
    """Time one configuration in this process (called in a subprocess by :func:`main`)."""
    import torch

    torch.set_num_threads(_threads())
    d = SIZES[model]
    mech, buffers = _mechanism(kind)
    mech.reset([(d,)], seed=0, dtype=torch.float32)
    for _ in range(warmup):
        mech.next()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = mech.next()
        times.append(time.perf_counter() - start)
        del out
    return {
        "mechanism": kind,
        "model": model,
        "d": d,
        "buffers": buffers,
        "noise_state_bytes": buffers * d * 4,
        "allocated": True,
        "ms_per_step_median": 1e3 * statistics.median(times),
        "ms_per_step_min": 1e3 * min(times),
        "repeats": repeats,
        "threads": _threads(),
        # Linux reports ru_maxrss in KiB
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one", nargs=2, metavar=("MECHANISM", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be >= 5")
    if args.one:
        print(json.dumps(run_one(*args.one, args.warmup, args.repeats)))
        return

    import pandas as pd

    rows = []
    for kind, model in CONFIGS:
        cmd = [sys.executable, __file__, "--one", kind, model, "--warmup", str(args.warmup)]
        cmd += ["--repeats", str(args.repeats)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    d = SIZES["gpt2_124M"]
    rows.append(
        {
            "mechanism": "bandmf_b128",
            "model": "gpt2_124M",
            "d": d,
            "buffers": BANDS - 1,
            "noise_state_bytes": (BANDS - 1) * d * 4,
            "allocated": False,
            "ms_per_step_median": float("nan"),
            "ms_per_step_min": float("nan"),
            "repeats": 0,
            "threads": _threads(),
            "peak_rss_mib": float("nan"),
        }
    )
    df = pd.DataFrame(rows)
    df.to_csv(args.out, index=False)
    print(f"| mechanism | model | buffers | noise state | ms / step (median of {args.repeats}) | peak RSS |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms_per_step_median']:.1f}" if r["allocated"] else "not allocated"
        rss = f"{r['peak_rss_mib'] / 1024:.2f} GiB" if r["allocated"] else ""
        print(
            f"| {r['mechanism']} | {r['model']} | {r['buffers']} | {r['noise_state_bytes'] / 2**30:.2f} GiB "
            f"| {ms} | {rss} |"
        )
    print(f"\nthreads={_threads()}; wrote {args.out}")


if __name__ == "__main__":
    main()
