"""``sweep --launcher slurm --dry-run``: the sbatch parameters come from Hydra's composed launcher config, and
nothing is submitted."""

from __future__ import annotations

import subprocess

import pytest

from dp_adam_bench.cli import main
from dp_adam_bench.sweep import (
    count_jobs,
    run_sweep,
    sbatch_lines,
    slurm_launcher_params,
    sweep_commands,
    sweep_spec,
)


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("a dry run must not launch anything")

    monkeypatch.setattr(subprocess, "run", refuse)


def test_launcher_params_are_hydras_composed_slurm_config():
    params = slurm_launcher_params("tang_fig1_cifar10", "paper", ["hydra.launcher.partition=gpu", "seed=0,1"])
    assert params["_target_"].endswith("SlurmLauncher")
    assert params["partition"] == "gpu" and params["gpus_per_node"] == 1 and params["cpus_per_task"] == 8
    assert params["mem_gb"] == 64 and params["timeout_min"] == 240 and params["array_parallelism"] == 32
    assert params["submitit_folder"].endswith("/.submitit/%j") and params["name"] == "train"


def test_jobs_per_command_follow_hydras_sweep_syntax():
    assert (
        count_jobs(["python", "-m", "x", "-m", "a=1,2,3", "b=range(0,4)", "c=5", "hydra/launcher=slurm"])
        == 12
    )
    assert [count_jobs(c) for c in sweep_commands("tang_fig1_cifar10", "paper", "slurm")] == [3, 3, 3]


def test_sbatch_lines_are_submitits_translation():
    params = slurm_launcher_params("tang_fig1_cifar10", "paper", ["hydra.launcher.mem_gb=32"])
    lines = sbatch_lines(params, 40)
    assert "#SBATCH --array=0-39%32" in lines  # at most array_parallelism at once
    assert "#SBATCH --mem=32GB" in lines and "#SBATCH --time=240" in lines
    assert "#SBATCH --gpus-per-node=1" in lines and "#SBATCH --cpus-per-task=8" in lines
    assert not any(line.startswith("#SBATCH --array") for line in sbatch_lines(params, 1))


def test_slurm_dry_run_prints_sbatch_parameters_and_commands(capsys, no_launch):
    overrides = [
        "hydra.launcher.partition=gpu",
        "hydra.launcher.gpus_per_node=2",
        "hydra.launcher.timeout_min=600",
    ]
    assert run_sweep("tang_fig1_cifar10", "paper", "slurm", overrides, dry_run=True) == 0
    out = capsys.readouterr().out
    for line in (
        "SLURM launcher (hydra.launcher composed for experiment=tang_fig1_cifar10 profile=paper):",
        "  partition: gpu",
        "  gpus_per_node: 2",
        "  cpus_per_task: 8",
        "  mem_gb: 64",
        "  timeout_min: 600",
        "  array_parallelism: 32",
        "  #SBATCH --partition=gpu",
        "  #SBATCH --gpus-per-node=2",
        "  #SBATCH --cpus-per-task=8",
        "  #SBATCH --mem=64GB",
        "  #SBATCH --time=600",
        "  command 1: 3 jobs, #SBATCH --array=0-2%3",
    ):
        assert line in out.splitlines(), line
    assert "  submitit_folder: " in out and "/.submitit/%A_%a/%A_%a_0_log.out" in out  # the log folder
    commands = [line for line in out.splitlines() if line.startswith("+ ")]
    assert len(commands) == 3 and all(
        "hydra/launcher=slurm" in c and "hydra.launcher.partition=gpu" in c for c in commands
    )


def test_cli_slurm_dry_run_and_a_null_partition_says_so(capsys, no_launch):
    assert main(["sweep", "ganesh_fig2", "--launcher", "slurm", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "  partition: null" in out and "set hydra.launcher.partition=..." in out
    assert "#SBATCH --partition" not in out
    assert "  command 1: 13 jobs, #SBATCH --array=0-12%13" in out


def test_other_launchers_print_only_the_commands(capsys, no_launch):
    assert run_sweep("tang_fig1_cifar10", "cpu", "joblib", dry_run=True) == 0
    out = capsys.readouterr().out
    assert "SLURM" not in out and "#SBATCH" not in out and out.count("+ ") == 3


def test_dry_run_prints_lines_a_shell_runs_as_they_are(capsys):
    """Each printed command starts with the interpreter and survives a POSIX shell unchanged: ``choice(...)``
    (parentheses) and an override with a space or quotes come back as the same arguments."""
    import shlex
    import sys

    overrides = ["+tags=['a b']"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "run", lambda *_, **__: pytest.fail("a dry run must not launch anything"))
        assert run_sweep("ganesh_fig3_tuning", "cpu", dry_run=True, overrides=overrides) == 0
    printed = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("+ ")]
    commands = sweep_commands("ganesh_fig3_tuning", "cpu", overrides=overrides)
    entries = sweep_spec("ganesh_fig3_tuning", "cpu").entries
    assert len(printed) == len(commands) == len(entries) > 1  # one multirun per entry
    assert any("choice(0.0001)" in line for line in printed)
    for line, cmd in zip(printed, commands, strict=True):
        assert cmd[:4] == [sys.executable, "-m", "dp_adam_bench.train", "-m"]
        assert line.startswith(shlex.quote(sys.executable) + " -m dp_adam_bench.train -m ")
        echoed = subprocess.check_output(["bash", "-c", f"printf '%s\\n' {line}"], text=True)
        assert echoed.splitlines() == cmd
