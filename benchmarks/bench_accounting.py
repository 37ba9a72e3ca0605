"""Cost of calibrating sigma for a target epsilon, per accountant (dp_adam_bench.privacy.accounting).

Settings: the reference run of docs/pitfalls.md (q = 0.04, T = 2000), Li et al.'s E2E run (q = 512 / 42061,
T = ceil(50 / q) = 4108) and the "typical" q = 0.01, T = 10000 of the accounting module's speed target; all at
delta = 1e-5, eps = 8, the default tolerance (eps within 0.01 below the target). Each timing is cold: the
accounting caches are cleared before every call, so no epsilon computed earlier is reused. Also reported: the
cost of one epsilon evaluation at the calibrated sigma, and that epsilon.

    .venv/bin/python benchmarks/bench_accounting.py  # table on stdout, benchmarks/results_accounting.csv
    .venv/bin/python benchmarks/bench_accounting.py --repeats 5
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(REPO_ROOT))

import pandas as pd  # noqa: E402

from dp_adam_bench.privacy import accounting  # noqa: E402

DELTA = 1e-5
TARGET = 8.0
SETTINGS = {
    "pitfalls q=0.04 T=2000": (0.04, 2000),
    "li_e2e q=512/42061 T=4108": (512 / 42061, math.ceil(50 / (512 / 42061))),
    "typical q=0.01 T=10000": (0.01, 10000),
}
OUT = Path(__file__).resolve().parent / "results_accounting.csv"


def _clear_caches() -> None:
    accounting.clear_caches()


def _time(fn, repeats: int) -> tuple[float, float, object]:
    times, result = [], None
    for _ in range(repeats):
        _clear_caches()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), result


def run(repeats: int) -> pd.DataFrame:
    rows = []
    for name, (q, steps) in SETTINGS.items():
        for acc in accounting.guarantee_names():  # gdp_clt is an approximation: never calibrated

            def calibrate(acc=acc, q=q, steps=steps):
                return accounting.calibrate_sigma(TARGET, DELTA, q, steps, acc)

            med, best, sigma = _time(calibrate, repeats)

            def evaluate(acc=acc, q=q, steps=steps, sigma=sigma):
                return accounting.epsilon(sigma, q, steps, DELTA, acc)

            eps_med, _, eps = _time(evaluate, repeats)
            rows.append(
                {
                    "setting": name,
                    "q": q,
                    "steps": steps,
                    "accountant": acc,
                    "calibrate_s_median": med,
                    "calibrate_s_min": best,
                    "sigma": sigma,
                    "epsilon": eps,
                    "epsilon_eval_s_median": eps_med,
                    "repeats": repeats,
                }
            )
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame) -> str:
    lines = [
        "| setting | accountant | calibrate sigma, s (median / min) | sigma | eps at sigma | eps eval, s |",
        "|---|---|---|---|---|---|",
    ]
    for _, r in df.iterrows():
        lines.append(
            f"| {r.setting} | {r.accountant} | {r.calibrate_s_median:.3f} / {r.calibrate_s_min:.3f} | "
            f"{r.sigma:.4f} | {r.epsilon:.4f} | {r.epsilon_eval_s_median:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    df = run(args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print(f"sigma calibration to eps = {TARGET:g}, delta = {DELTA:g}, cold caches, {args.repeats} repeats\n")
    print(markdown(df))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
