"""``dp-adam-bench report EXPERIMENT`` for any experiment name (issue 58, dp_adam_bench/report/experiment.py).

The slow test runs the issue's 2 x 2 Hydra multirun through the training entry point and checks the report against
the runs' own summary.json files (mean and sample std recomputed here, Welch's t, df and p from scipy and the
Welch-Satterthwaite formula). The fast tests use synthetic run folders: grouping, what never splits a cell, runs
left out, comparisons and the refusals."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from scipy import stats as scipy_stats

from dp_adam_bench import cli
from dp_adam_bench.report import experiment
from dp_adam_bench.report.context import ReportContext

GRID = "newcomer_2x2"
#: the issue's multirun, made quick: 200 training examples (200 single-pass steps), 500 test points, 3 trials
MULTIRUN = [
    "-m",
    "task=logistic_1d",
    "optimizer=sgd,adambc",
    "seed=0,1",
    f"experiment_name={GRID}",
    "task.n_train=200",
    "task.n_test=500",
    "task.trials=3",
    "train.log_every=20",
    "logger.wandb.mode=disabled",
]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The run store of the 2 x 2 multirun, run once by ``python -m dp_adam_bench.train``."""
    root = tmp_path_factory.mktemp("grid")
    env = {**os.environ, "DP_ADAM_BENCH_RUNS": str(root / "runs"), "DP_ADAM_BENCH_PROGRESS": "off"}
    done = subprocess.run(
        [sys.executable, "-m", "dp_adam_bench.train", *MULTIRUN],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "runs"


def summaries(folder):
    """{run folder name: summary.json} of the experiment's run folders that have one."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.glob("*/summary.json"))}


def welch_df(a, b):
    """Welch-Satterthwaite degrees of freedom, written out (the oracle of the report's df)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    return (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))


@pytest.mark.slow
def test_the_report_of_a_2x2_multirun(grid, tmp_path, monkeypatch, capsys):
    """Two cells of n = 2 (seeds pooled) with their epsilon; the Welch comparison along optimizer with its df and
    p (scipy's); the learning curves; a run made incomplete listed and left out of the numbers."""
    runs = tmp_path / "runs"
    shutil.copytree(grid, runs)
    complete = summaries(runs / GRID)
    assert len(complete) == 4
    # a fifth run: a copy of one whose summary says it did not finish
    first = sorted((runs / GRID).iterdir())[0]
    broken = runs / GRID / "copy-not-finished"
    shutil.copytree(first, broken)
    s = json.loads((broken / "summary.json").read_text())
    (broken / "summary.json").write_text(json.dumps({**s, "status": "running"}))
    monkeypatch.setenv("DP_ADAM_BENCH_RUNS", str(runs))
    monkeypatch.setenv("DP_ADAM_BENCH_RESULTS", str(tmp_path / "results"))

    argv = ["report", GRID, "--compare", "optimizer", "--baseline", "optimizer=sgd"]
    assert cli.main(argv) == 0
    out = tmp_path / "results"
    assert capsys.readouterr().out.split() == ["wrote", str(out / f"{GRID}.csv"), "wrote", str(out / f"{GRID}.md"),
                                               "wrote", str(out / f"{GRID}.png")]  # fmt: skip

    table = pd.read_csv(out / f"{GRID}.csv").set_index("optimizer")
    assert sorted(table.index) == ["adambc", "sgd"]
    values = {}
    for opt in ("sgd", "adambc"):
        mine = [s for name, s in complete.items() if name.startswith(f"{opt}-")]
        values[opt] = [s["metrics"]["test_loss"] for s in mine]
        row = table.loc[opt]
        assert row["n"] == 2 and sorted(s["seed"] for s in mine) == [0, 1]
        assert row["test_loss"] == pytest.approx(statistics.mean(values[opt]), rel=1e-9)
        assert row["test_loss_sample_std"] == pytest.approx(statistics.stdev(values[opt]), rel=1e-9)
        assert row["epsilon"] == pytest.approx(mine[0]["guarantee"]["epsilon"], rel=1e-9)
        assert row["accountant"] == "rdp" and row["steps"] == 200 and row["sigma"] == 1.0
        assert math.isnan(row["q"])  # single_pass: no sampling rate
    md = (out / f"{GRID}.md").read_text()

    hi, lo = sorted(values, key=lambda o: -statistics.mean(values[o]))
    welch = scipy_stats.ttest_ind(values[hi], values[lo], equal_var=False)
    df = welch_df(values[hi], values[lo])
    line = next(
        ln for ln in md.splitlines() if ln.startswith(f"- optimizer={hi} > optimizer={lo} in test_loss")
    )
    assert f"t = {welch.statistic:+.2f} (Welch, df {df:.1f})" in line
    state = "holds" if welch.pvalue < 0.05 else "agrees, not decided"
    assert f"**{state}**" in line and "over 2 / 2 seeds" in line
    base = f"optimizer=adambc {'>' if statistics.mean(values['adambc']) > statistics.mean(values['sgd']) else '<'}"
    assert f"- {base} optimizer=sgd (baseline) in test_loss: **{state}**" in md

    assert "## Runs not in the numbers (1)" in md
    assert "- `copy-not-finished` (optimizer=" in md and "status 'running'" in md
    assert (out / f"{GRID}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "optimizer.lr=0.1" in md and "optimizer.lr=0.001" in md  # what else differs, from the configs


# --------------------------------------------------------------------------------------------- synthetic runs


def fake(root, name, *, opt="sgd", lr=0.1, seed=0, loss=0.5, status="complete", extra=None, summary=True):
    """A run folder of experiment ``exp`` with a config and (``summary``) a summary.json."""
    folder = root / "exp" / name
    folder.mkdir(parents=True)
    cfg = {
        "task": {"name": "toy"},
        "optimizer": {"name": opt, "lr": lr},
        "privacy": {"sigma": 1.0},
        "train": {"batch_size": 4, "threads": seed, "log_every": 10 + seed},
        "logger": {"wandb": {"mode": "disabled" if seed else "offline"}},
        "experiment_name": "exp",
        "seed": seed,
        **(extra or {}),
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    if summary:
        s = {
            "status": status,
            "seed": seed,
            "metrics": {"test_loss": loss, "test_loss_std": 0.01},
            "guarantee": {"epsilon": 2.0, "accountant": "prv", "delta": 1e-5},
            "sigma": 1.0,
            "steps": 10,
            "privacy_plan": {"sampling_rate": 0.25, "accountant": "prv"},
        }
        (folder / "summary.json").write_text(json.dumps(s))
    with open(folder / "metrics.jsonl", "w") as fh:
        for step in (5, 10):
            fh.write(
                json.dumps({"step": step, "test_loss": None if loss is None else loss + 1 / step}) + "\n"
            )
    return folder


def section(md, heading):
    """The list lines of the markdown section whose heading starts with ``heading``."""
    body = md.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return [ln for ln in body.splitlines() if ln.startswith("- ")]


def ctx_for(tmp_path):
    return ReportContext(runs=tmp_path / "runs", out=tmp_path / "results")


def test_seeds_and_bookkeeping_never_split_a_cell_and_left_out_runs_are_listed(tmp_path):
    """Seeds, threads, log intervals and the W&B mode differ between the runs; only the optimizer splits them. A
    run with no summary, one with status 'stopped', and a diverged one (non-finite final metric, stored as null)
    are listed with why, and none counts in n; a cell whose only run is left out stays in the table with n = 0."""
    root = tmp_path / "runs"
    for seed, loss in enumerate([0.5, 0.7, 0.6]):
        fake(root, f"sgd-{seed}", seed=seed, loss=loss)
    for seed, loss in enumerate([0.4, 0.45]):
        fake(root, f"adam-{seed}", opt="adam", lr=0.01, seed=seed, loss=loss, extra=None)
    fake(root, "sgd-killed", seed=7, summary=False)
    fake(root, "sgd-stopped", seed=8, status="stopped")
    fake(root, "sgd-nan", seed=9, loss=None)
    fake(root, "ime-0", opt="ime", lr=0.01, summary=False)

    paths = experiment.build_experiment("exp", ctx_for(tmp_path))
    assert [p.name for p in paths] == ["exp.csv", "exp.md", "exp.png"]
    table = pd.read_csv(tmp_path / "results" / "exp.csv").set_index("optimizer")
    assert list(table.columns[:3]) == ["test_loss", "test_loss_sample_std", "n"]
    assert "test_loss_std" not in table.columns  # a run's own spread over trials is not a metric to average
    assert table.loc["sgd", "n"] == 3 and table.loc["adam", "n"] == 2 and table.loc["ime", "n"] == 0
    assert table.loc["sgd", "test_loss"] == pytest.approx(statistics.mean([0.5, 0.7, 0.6]))
    assert table.loc["sgd", "test_loss_sample_std"] == pytest.approx(statistics.stdev([0.5, 0.7, 0.6]))
    assert table.loc["adam", "epsilon"] == 2.0 and table.loc["adam", "q"] == 0.25
    assert table.loc["adam", "accountant"] == "prv"
    md = (tmp_path / "results" / "exp.md").read_text()
    assert "## Runs not in the numbers (4)" in md
    for name, why in [
        ("sgd-killed", "not finished: no summary.json"),
        ("sgd-stopped", "not complete: status 'stopped'"),
        ("sgd-nan", "diverged: final test_loss is not finite"),
        ("ime-0", "not finished"),
    ]:
        assert any(ln.startswith(f"- `{name}` (optimizer=") and why in ln for ln in md.splitlines()), name
    assert "by optimizer; metric `test_loss` (the default" in md
    assert "- optimizer=adam: optimizer.lr=0.01" in md  # lr follows from the optimizer: listed, not a column


def test_a_key_swept_beside_the_optimizer_is_a_column_and_compare_pairs_only_along_its_key(tmp_path):
    """optimizer x lr crossed: both are columns; --compare optimizer.lr pairs the lrs of one optimizer (two
    pairs), --compare optimizer the optimizers at one lr; a cell of one seed is untested."""
    root = tmp_path / "runs"
    losses = {
        ("sgd", 0.1): [0.5, 0.52],
        ("sgd", 0.01): [0.6, 0.61],
        ("adam", 0.1): [0.3, 0.9],
        ("adam", 0.01): [0.4],
    }
    for (opt, lr), vals in losses.items():
        for seed, loss in enumerate(vals):
            fake(root, f"{opt}-{lr}-{seed}", opt=opt, lr=lr, seed=seed, loss=loss)
    experiment.build_experiment("exp", ctx_for(tmp_path), compare=["optimizer.lr", "optimizer"])
    table = pd.read_csv(tmp_path / "results" / "exp.csv")
    assert list(table.columns[:2]) == ["optimizer", "optimizer.lr"] and len(table) == 4
    md = (tmp_path / "results" / "exp.md").read_text()
    lr_pairs = section(md, "Comparisons along optimizer.lr (")
    assert len(lr_pairs) == 2 and all(" at optimizer=" in ln for ln in lr_pairs)
    sgd = next(ln for ln in lr_pairs if "at optimizer=sgd" in ln)
    g = scipy_stats.ttest_ind([0.6, 0.61], [0.5, 0.52], equal_var=False)
    assert sgd.startswith("- optimizer.lr=0.01 > optimizer.lr=0.1 at optimizer=sgd in test_loss: **holds**")
    assert g.pvalue < 0.05 and f"df {welch_df([0.6, 0.61], [0.5, 0.52]):.1f}" in sgd
    adam = next(ln for ln in lr_pairs if "at optimizer=adam" in ln)
    assert "**untested**" in adam and "fewer than 2 seeds a cell" in adam
    opt_pairs = section(md, "Comparisons along optimizer (")
    assert len(opt_pairs) == 2 and all(" at optimizer.lr=" in ln for ln in opt_pairs)
    wide = next(ln for ln in opt_pairs if "at optimizer.lr=0.1 " in ln)
    assert wide.startswith(
        "- optimizer=adam > optimizer=sgd at optimizer.lr=0.1 in test_loss"
    )  # larger first
    assert "**agrees, not decided**" in wide and "seeds a cell would decide it" in wide


def test_baseline_compares_each_other_cell_with_the_baseline_in_the_observed_direction(tmp_path):
    root = tmp_path / "runs"
    for opt, lr, vals in [("sgd", 0.1, [0.5, 0.51]), ("adam", 0.01, [0.3, 0.31]), ("ime", 0.01, [0.7, 0.72])]:
        for seed, loss in enumerate(vals):
            fake(root, f"{opt}-{seed}", opt=opt, lr=lr, seed=seed, loss=loss)
    experiment.build_experiment("exp", ctx_for(tmp_path), baseline=["optimizer=sgd"])
    md = (tmp_path / "results" / "exp.md").read_text()
    lines = section(md, "Against the baseline optimizer=sgd")
    assert len(lines) == 2
    adam = next(
        ln for ln in lines if ln.startswith("- optimizer=adam < optimizer=sgd (baseline) in test_loss: ")
    )
    g = scipy_stats.ttest_ind([0.3, 0.31], [0.5, 0.51], equal_var=False)  # adam - sgd: t < 0, as the gap
    assert (
        g.pvalue < 0.05
        and "**holds**" in adam
        and f"gap -0.2; t = {g.statistic:+.2f} (Welch, df 2.0)" in adam
    )
    assert any(
        ln.startswith("- optimizer=ime > optimizer=sgd (baseline) in test_loss: **holds**") for ln in lines
    )
    with pytest.raises(ValueError, match="no cell has optimizer.name=rmsprop; its values: adam, ime, sgd"):
        experiment.build_experiment("exp", ctx_for(tmp_path), baseline=["optimizer=rmsprop"])
    with pytest.raises(ValueError, match="'privacy.sigma' does not vary across the runs"):
        experiment.build_experiment("exp", ctx_for(tmp_path), compare=["privacy.sigma"])
    with pytest.raises(ValueError, match="--metric 'test_accuracy': no complete run has it"):
        experiment.build_experiment("exp", ctx_for(tmp_path), metric="test_accuracy")


def test_label_keys_keep_the_fewest_keys_that_tell_the_cells_apart():
    keys = ["optimizer.name", "optimizer.lr", "noise.kind", "optimizer.beta1"]
    points = [
        ("sgd", 0.1, "a", "—"),
        ("adam", 0.01, "a", 0.9),
        ("sgd", 0.1, "b", "—"),
        ("adam", 0.01, "b", 0.9),
    ]
    assert experiment.label_keys(keys, points) == ["optimizer.name", "noise.kind"]
    crossed = [("sgd", 0.1), ("sgd", 0.01), ("adam", 0.1)]
    assert experiment.label_keys(keys[:2], crossed) == keys[:2]
    assert experiment.label_keys([], [()]) == []


def test_an_unknown_name_without_runs_is_one_line_naming_tables_and_the_run_store(isolated_dirs, capsys):
    assert cli.main(["report", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"error: unknown table 'nope', and no runs of an experiment named 'nope' in "
                             f"{isolated_dirs / 'runs' / 'nope'}; valid tables and groups: ")  # fmt: skip
    assert "ganesh_fig2" in err[0] and "privacy" in err[0]


def test_experiment_options_are_refused_for_a_registry_table(isolated_dirs, capsys):
    assert cli.main(["report", "ganesh_quadratic", "--compare", "optimizer"]) == 2
    assert "are for an experiment's runs, not table 'ganesh_quadratic'" in capsys.readouterr().err
