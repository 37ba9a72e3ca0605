"""``dp-adam-bench sweep NAME key=a,b ...``: a grid of the user's own, not a preset (issue 58, dp_adam_bench/sweep.py).

The slow test launches the issue's 2 x 2 logistic_1d grid through ``cli.main``, finds its four run folders (one per
optimizer and seed, each complete), launches it again (every run complete: one line, no multirun started) and
reports it. The fast tests check the command the grid runs and each refusal."""

from __future__ import annotations

import itertools
import json
import subprocess

import pytest
import yaml
from omegaconf import OmegaConf

from dp_adam_bench import cli, sweep
from dp_adam_bench.paths import CONFIG_DIR

GRID = "newcomer_2x2"
OPTIMIZERS, SEEDS = ("sgd", "adambc"), (0, 1)
#: the issue's grid, made quick: 200 training examples (200 single-pass steps), 500 test points, 3 trials
OVERRIDES = [
    "task=logistic_1d",
    f"optimizer={','.join(OPTIMIZERS)}",
    f"seed={','.join(map(str, SEEDS))}",
    "task.n_train=200",
    "task.n_test=500",
    "task.trials=3",
    "train.log_every=20",
    "logger.wandb.mode=disabled",
]


def complete_runs(folder) -> dict:
    """{run folder name: its config} of the folders under ``folder`` whose summary says complete."""
    out = {}
    for path in sorted(folder.glob("*/summary.json")):
        if json.loads(path.read_text()).get("status") == "complete":
            out[path.parent.name] = yaml.safe_load((path.parent / "config.yaml").read_text())
    return out


@pytest.mark.slow
def test_a_grid_of_ones_own_runs_skips_when_complete_and_reports(isolated_dirs, monkeypatch, capsys):
    monkeypatch.chdir(isolated_dirs)
    monkeypatch.setenv("DP_ADAM_BENCH_PROGRESS", "lines")
    launched = []
    real_run = subprocess.run

    def run(cmd, **kwargs):
        launched.append(list(cmd))
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(sweep.subprocess, "run", run)
    assert cli.main(["sweep", GRID, *OVERRIDES]) == 0
    assert len(launched) == 1 and launched[0][launched[0].index("-m", 2) + 1 :] == [  # one multirun, as given
        f"experiment_name={GRID}",
        *OVERRIDES,
    ]
    runs = complete_runs(isolated_dirs / "runs" / GRID)
    assert len(runs) == 4
    cells = sorted((c["optimizer"]["name"], c["seed"]) for c in runs.values())
    assert cells == sorted(itertools.product(OPTIMIZERS, SEEDS))
    stamps = {
        name: (isolated_dirs / "runs" / GRID / name / "summary.json").stat().st_mtime_ns for name in runs
    }
    capsys.readouterr()

    assert cli.main(["sweep", GRID, *OVERRIDES]) == 0  # again: every run is complete, nothing is launched
    out, err = capsys.readouterr()
    assert f"sweep {GRID}: all 4 runs are complete, nothing to launch" in out
    assert f"sweep {GRID}: 4/4 runs complete" in err
    assert len(launched) == 1
    assert stamps == {
        n: (isolated_dirs / "runs" / GRID / n / "summary.json").stat().st_mtime_ns for n in runs
    }

    assert cli.main(["report", GRID, "--compare", "optimizer"]) == 0
    table = (isolated_dirs / "results" / f"{GRID}.csv").read_text().splitlines()
    header = table[0].split(",")
    rows = {line.split(",")[header.index("optimizer")]: line.split(",") for line in table[1:]}
    assert sorted(rows) == sorted(OPTIMIZERS)
    assert all(row[header.index("n")] == "2" for row in rows.values())
    assert "## Comparisons along optimizer" in (isolated_dirs / "results" / f"{GRID}.md").read_text()

    capsys.readouterr()
    assert (
        cli.main(["wandb-dashboard", "--project", "ENTITY/PROJECT", "--experiment", GRID, "--dry-run"]) == 0
    )
    plan = capsys.readouterr().out
    assert f"runs: W&B group = '{GRID}' (the run store's runs of {GRID}" in plan
    assert "by optimizer: y=test_loss, test_loss_mean vs Step; grouped by config.optimizer.name" in plan


def test_the_dry_run_prints_one_multirun_of_the_grid_with_the_launcher(isolated_dirs, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cli.main(["sweep", GRID, "task=logistic_1d", "optimizer=sgd,adambc", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"+ {sweep.python_executable()} -m dp_adam_bench.train -m experiment_name={GRID} task=logistic_1d "
        "optimizer=sgd,adambc"
    ]
    argv = ["sweep", GRID, "optimizer=sgd,adambc", "--profile", "paper", "--jobs", "2", "--dry-run"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "joblib: 2 runs at once, 1 torch thread(s) each, on the CPU"
    assert out[1].endswith(
        f"-m experiment_name={GRID} profile=paper hydra/launcher=joblib hydra.launcher.n_jobs=2 train.threads=1 "
        "optimizer=sgd,adambc"
    )
    assert not (isolated_dirs / "runs").exists()


REFUSED = {
    # no overrides: nothing says what to run
    ("my_grid",): "unknown experiment 'my_grid' and no overrides to sweep",
    ("my_grid", "hydra.verbose=true"): "unknown experiment 'my_grid' and no overrides to sweep",
    # the name left out: the first override taken for it
    ("optimizer=sgd,adambc", "seed=0,1"): "'optimizer=sgd,adambc' is an override, not a name",
    ("_hidden", "seed=0,1"): "'_hidden' cannot name an ad-hoc grid's run folder",
    # a preset's run folder, a report table
    ("ganesh_fig3_cpu", "seed=0,1"): "'ganesh_fig3_cpu' is the run folder of preset ganesh_fig3's runs",
    ("ganesh_fig3_paper", "seed=0,1"): "'ganesh_fig3_paper' is the run folder of preset ganesh_fig3's runs",
    ("default", "seed=0,1"): "'default' is a report table",
    (
        "my_grid",
        "seed=0,1",
        "experiment_name=other",
    ): "'experiment_name=other': an ad-hoc grid's runs are named by",
    # an override that does not compose: the training entry point's line
    ("my_grid", "optimizer=nosuch"): "optimizer=nosuch is not an option of optimizer; valid: ",
}


@pytest.mark.parametrize("argv", list(REFUSED), ids=[" ".join(a) for a in REFUSED])
def test_what_cannot_be_a_grid_is_refused_in_one_line(argv, isolated_dirs, capsys):
    assert cli.main(["sweep", *argv, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {REFUSED[argv]}") and err.count("\n") == 1
    assert not (isolated_dirs / "runs").exists()


def test_plan_and_smoke_are_refused_for_a_grid(isolated_dirs, capsys):
    for flag in ("--plan", "--smoke"):
        assert cli.main(["sweep", "my_grid", "seed=0,1", flag]) == 2
        assert capsys.readouterr().err == (
            "error: --plan and --smoke take a preset, and my_grid is an ad-hoc grid: --dry-run prints its multirun "
            "command\n"
        )


def test_a_preset_keeps_its_own_sweep():
    """A preset's name is its sweep, overrides or not; never an ad-hoc grid."""
    assert sweep.adhoc_error("my_grid", ["seed=0,1"]) is None
    assert sweep.is_preset("ganesh_quadratic") and not sweep.is_preset("my_grid")
    assert sweep.adhoc_commands("my_grid", overrides=["seed=0,1"])[0][-2:] == [
        "experiment_name=my_grid",
        "seed=0,1",
    ]
    assert all("experiment=ganesh_quadratic" in cmd for cmd in sweep.sweep_commands("ganesh_quadratic"))


@pytest.mark.parametrize("profile", ["cpu", "paper"])
def test_the_preset_folders_read_from_the_files_are_the_composed_ones(profile):
    """preset_folder_names reads each preset's experiment_name from its file: the composed config agrees."""
    folders = sweep.preset_folder_names()
    for name in sweep.presets():
        composed = sweep.load_preset(name, profile)["experiment_name"]
        assert folders.get(composed) == name, (name, composed)
    assert (CONFIG_DIR / "config.yaml").exists() and OmegaConf.load(
        CONFIG_DIR / "config.yaml"
    ).profile == sweep.ROOT_PROFILE


def test_the_readme_runs_this_grid_and_report():
    """The README's "Your own comparison" commands are the ones the slow test runs (there made quick)."""
    import shlex

    from dp_adam_bench.paths import REPO_ROOT

    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Your own comparison\n") :]
    block = section[
        section.index("```bash\n") + len("```bash\n") : section.index("```\n", section.index("```bash"))
    ]
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert commands == [
        [".venv/bin/dp-adam-bench", "sweep", GRID, *OVERRIDES[:3]],
        [".venv/bin/dp-adam-bench", "report", GRID, "--compare", "optimizer"],
        [
            ".venv/bin/dp-adam-bench",
            "wandb-dashboard",
            "--project",
            "ENTITY/PROJECT",
            "--experiment",
            GRID,
            "--dry-run",
        ],
    ]
    assert all(o.startswith(("task.", "train.", "logger.")) for o in OVERRIDES[3:])  # only made quick
