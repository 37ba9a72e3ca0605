"""Cost of the engine watch (``dp_adam_bench/engine/watch.py``, issue 44): the engine probe and self-check made
again on the weights training reaches, against the training step they watch.

Per model (the engine benchmark's builders, :mod:`bench_engines`), through ``make_private`` with bk:

* ``step_s_median``: one private training step (sampling, clipping, noise, the ``adam`` update, the noise check);
* ``check_s_median``: one periodic check (probe with its perturbation when a gradient is zero, self-check on 4
  random examples), ``start_check_s``: the start-up check (the same and the equalized norms);
* ``steps_per_check``: how many steps the ``auto`` schedule trains between two periodic checks at the 2 % budget,
  check_s / (0.02 x step_s);
* ``run_share``: the share of training time the checks took over a run of ``run_steps`` steps under ``auto``, the
  start-up check included (``summary["engine_watch"]["share_of_training_time"]``, measured, not derived).

    .venv/bin/python benchmarks/bench_checks.py            # CNN5 B = 256, BERT-tiny B = 32
    .venv/bin/python benchmarks/bench_checks.py --quick    # tiny shapes, a few steps (tests; numbers meaningless)

Threads: ``BENCH_THREADS`` (default 2). One torch job at a time on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: (model, batch size, steps of the measured run) of a full run
FULL = (("cnn5", 256, 200), ("bert_tiny", 32, 200))
QUICK = (("cnn5", 8, 6), ("bert_tiny", 4, 6))
COLUMNS = [
    "model",
    "batch_size",
    "engine",
    "params",
    "step_s_median",
    "check_s_median",
    "start_check_s",
    "steps_per_check",
    "run_steps",
    "run_checks",
    "run_share",
    "budget",
    "threads",
    "torch_version",
    "date",
]


def measure(model_name: str, b: int, run_steps: int, quick: bool) -> dict:
    import bench_engines
    import torch

    from dp_adam_bench import api, make_private

    torch.manual_seed(0)
    bm = bench_engines.MODELS[model_name](quick=quick)
    n = max(8 * b, 64)
    batch = bm.make_batch(n, torch.Generator().manual_seed(1))
    target = "y" if "y" in batch else "labels"
    dataset = [{k: v[i] for k, v in batch.items()} for i in range(n)]

    class BenchTask(api.UserTask):  # the benchmark model's own per-example loss
        def loss_per_example(self, forward, batch):
            return bm.loss_per_example(forward, batch)

    def unused(output, target):  # make_private's loss_fn; BenchTask computes the loss itself
        raise AssertionError("not called")

    unused.reduction = "none"
    real, api.UserTask = api.UserTask, BenchTask
    try:
        private = make_private(
            bm.model,
            dataset,
            unused,
            optimizer="adam",
            sigma=1.0,
            clip=1.0,
            batch_size=b,
            steps=run_steps,
            lr=1e-3,
            target_key=target,
            clipping="bk",
            seed=0,
        )
    finally:
        api.UserTask = real
    watch = private.watch
    start = watch.checks[0]["seconds"]
    steps = []
    while not private.done:
        t0 = time.perf_counter()
        private.step()
        steps.append(time.perf_counter() - t0)
    described = watch.describe()
    checks = []
    for _ in range(3):
        t0 = time.perf_counter()
        watch.check(private.steps_done, "periodic")
        checks.append(time.perf_counter() - t0)
    step_s, check_s = statistics.median(steps), statistics.median(checks)
    return {
        "model": model_name,
        "batch_size": b,
        "engine": "bk",
        "params": sum(p.numel() for p in private.params),
        "step_s_median": step_s,
        "check_s_median": check_s,
        "start_check_s": start,
        "steps_per_check": check_s / (watch.budget * step_s),
        "run_steps": len(steps),
        "run_checks": described["checks"],
        "run_share": described["share_of_training_time"],
        "budget": watch.budget,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few steps (numbers meaningless)")
    parser.add_argument("--out", type=Path, default=HERE / "results_checks.csv")
    args = parser.parse_args(argv)
    import pandas as pd
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    rows = []
    for model_name, b, run_steps in QUICK if args.quick else FULL:
        rows.append(measure(model_name, b, run_steps, args.quick))
        r = rows[-1]
        print(
            f"{model_name} B={b}: step {r['step_s_median']:.3f} s, check {r['check_s_median']:.3f} s "
            f"(start {r['start_check_s']:.3f} s), a check every {r['steps_per_check']:.0f} steps at "
            f"{100 * r['budget']:g} %; run of {r['run_steps']} steps: {r['run_checks']} checks, "
            f"{100 * r['run_share']:.2f} % of its training time",
            flush=True,
        )
    pd.DataFrame(rows, columns=COLUMNS).to_csv(args.out, index=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
