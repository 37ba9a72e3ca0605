"""A sweep killed half-way and launched again ends with the same table as an uninterrupted one."""

import os
import re
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from dp_adam_bench.report import ganesh_fig2

OVERRIDES = [
    "task.n_train=40",
    "task.n_test=200",
    "task.trials=2",
    "logger.wandb.mode=disabled",
    "optimizer.lr=1.0",
]  # 7 (optimizer, noise) pairs x 1 learning rate = 7 runs


RUNS = 7


def sweep_cmd():
    return [sys.executable, "-m", "dp_adam_bench", "sweep", "ganesh_fig2", "--launcher", "joblib", *OVERRIDES]


def complete_runs(root):
    return list((root / "ganesh_fig2").glob("*/summary.json"))


@pytest.mark.slow
def test_killed_joblib_sweep_relaunched_gives_the_same_table(tmp_path, monkeypatch):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    a, b = tmp_path / "a", tmp_path / "b"
    subprocess.run(sweep_cmd(), env={**env, "DP_ADAM_BENCH_RUNS": str(a)}, check=True, capture_output=True)
    assert len(complete_runs(a)) == RUNS

    proc = subprocess.Popen(
        sweep_cmd(),
        env={**env, "DP_ADAM_BENCH_RUNS": str(b)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 180
    while len(complete_runs(b)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole sweep: launcher, joblib workers, everything
    proc.wait()
    killed_at = len(complete_runs(b))
    assert 3 <= killed_at < RUNS, f"the kill came at {killed_at} complete runs"

    again = subprocess.run(
        sweep_cmd(), env={**env, "DP_ADAM_BENCH_RUNS": str(b)}, check=True, capture_output=True, text=True
    )
    assert len(complete_runs(b)) == RUNS
    # the relaunch (with config overrides) counts the runs the killed launch completed, and ends at 7/7
    counts = [
        tuple(map(int, m)) for m in re.findall(r"sweep ganesh_fig2: (\d+)/(\d+) runs complete", again.stderr)
    ]
    assert counts and {total for _, total in counts} == {RUNS}, again.stderr[-2000:]
    assert counts[0][0] >= killed_at and counts[-1][0] == RUNS, counts

    tables = []
    for root, out in ((a, tmp_path / "res_a"), (b, tmp_path / "res_b")):
        monkeypatch.setenv("DP_ADAM_BENCH_RUNS", str(root))
        monkeypatch.setenv("DP_ADAM_BENCH_RESULTS", str(out))
        ganesh_fig2.build()
        tables.append(pd.read_csv(out / "ganesh_fig2.csv"))
    pd.testing.assert_frame_equal(tables[0], tables[1])
