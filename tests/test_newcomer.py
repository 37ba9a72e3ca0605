"""Issue 28, "a newcomer's hour": what a first hour with the harness tripped over, each checked where it was found
(the bad-input cases are in tests/test_bad_inputs.py, the progress lines in tests/test_progress.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dp_adam_bench import train as train_mod
from dp_adam_bench.tasks import registry

from helpers import compose_cfg, tiny_data, tiny_model, tiny_poisson

TOY = [
    "task=logistic_1d",
    "task.n_train=60",
    "task.n_test=100",
    "task.trials=2",
    "logger.wandb.mode=disabled",
]


@pytest.fixture
def tiny(monkeypatch, isolated_dirs):
    monkeypatch.setitem(registry.TASKS, "tiny", "tiny_task:TinyTask")


# --- which epsilon --------------------------------------------------------------------------------------------------
def test_a_budget_held_exactly_says_so_in_the_summary(isolated_dirs):
    """Single pass, one Gaussian release: the budget 4.5 holds under its exact epsilon (4.377 for this release)
    while rdp reports 4.7285, a looser bound on it; the summary names both accountants."""
    summary = train_mod.train(compose_cfg([*TOY, "privacy.epsilon_budget=4.5", "task.n_train=1000"]))
    g = summary["guarantee"]
    assert g["accountant"] == "rdp" and g["epsilon"] == pytest.approx(summary["epsilon"]["rdp"])
    assert g["epsilon"] > 4.5 > g["exact_gaussian_epsilon"]
    assert g["exact_gaussian_epsilon"] == pytest.approx(4.377, abs=1e-3)
    assert g["budget_accountant"] == "exact_gaussian" and g["epsilon_budget"] == 4.5
    assert summary["stopped_by_budget"] is False
    assert any("epsilon_budget = 4.5 holds" in n and "exact_gaussian" in n for n in summary["privacy_notes"])


def test_the_command_line_prints_the_guarantee_with_its_accountants():
    g = {"accountant": "rdp", "epsilon": 4.7285, "delta": 1e-5, "exact_gaussian_epsilon": 4.3772}
    budget = {**g, "epsilon_budget": 4.5, "budget_accountant": "exact_gaussian"}
    assert train_mod.guarantee_line(budget) == (
        "epsilon (rdp) = 4.729 at delta = 1e-05; privacy.epsilon_budget = 4.5 met under exact_gaussian (4.377)"
    )
    target = {
        "accountant": "prv",
        "epsilon": 3.0,
        "delta": 1e-5,
        "target_epsilon": 3,
        "target_accountant": "prv",
    }
    assert train_mod.guarantee_line(target).endswith("privacy.target_epsilon = 3 met under prv")


def test_a_poisson_budget_is_enforced_by_the_runs_accountant(isolated_dirs):
    over = ["noise=independent", "train.sampler=poisson", "train.batch_size=5", "train.steps=200"]
    summary = train_mod.train(compose_cfg([*TOY, *over, "privacy.sigma=2", "privacy.epsilon_budget=3"]))
    g = summary["guarantee"]
    assert g["budget_accountant"] == g["accountant"] == "rdp"
    assert summary["stopped_by_budget"] and g["epsilon"] <= 3 and "exact_gaussian_epsilon" not in g


def test_make_private_says_which_accountant_met_the_target():
    import dp_adam_bench as dab

    _, dataset = tiny_data()
    private = dab.make_private(
        tiny_model(), dataset, _ce, optimizer="adam",
        noise="bandmf", noise_args={"bands": 2}, sigma=None, target_epsilon=4.0, batch_size=16, epochs=1,
    )  # fmt: skip
    g = private.guarantee()
    assert g["target_epsilon"] == 4.0 and g["target_accountant"] == "exact_gaussian"
    assert g["exact_gaussian_epsilon"] == pytest.approx(4.0, rel=1e-6)
    assert g["accountant"] == "rdp" and g["epsilon"] > 4.0  # rdp's bound on the same release is looser
    assert any("exact_gaussian" in n for n in private.notes)
    none = dab.make_private(tiny_model(), dataset, _ce, noise="none", batch_size=16, steps=2)
    assert none.guarantee() == {}


def _ce(out, y):
    from torch import nn

    return nn.functional.cross_entropy(out, y, reduction="none")


# --- launches -------------------------------------------------------------------------------------------------------
def test_a_running_run_is_refused_before_its_set_up(tiny, monkeypatch, capsys):
    """The lock is looked at before the task's data and model are built (which took ~36 s for CIFAR-10)."""
    from dp_adam_bench.engine import trainer
    from dp_adam_bench.paths import runs_dir
    from dp_adam_bench.tracking.run_store import RunFolder, RunLock, RunLockedError, run_id

    cfg = compose_cfg(tiny_poisson("locked", 3))
    data = train_mod.run_config(cfg)
    held = RunFolder.acquire(runs_dir(), "locked", run_id(data))

    def no_set_up(_cfg):
        raise AssertionError("the run was set up although its folder is locked")

    monkeypatch.setattr(trainer, "build", no_set_up)
    try:
        with pytest.raises(RunLockedError, match="the same run is already running"):
            train_mod.train(cfg)
    finally:
        held.release()
    RunLock.check(held.path)  # released: no error, and nothing created by the look
    RunLock.check(held.path.parent / "never-ran")
    assert not (held.path.parent / "never-ran").exists()


def test_a_run_prints_its_folder(tiny, capsys):
    summary = train_mod.train(compose_cfg(tiny_poisson("where", 2)))
    assert summary["status"] == "complete"
    err = capsys.readouterr().err
    folder = err.split("run folder: ", 1)[1].split()[0]
    assert json.loads((Path(folder) / "summary.json").read_text())["status"] == "complete"


# --- small --------------------------------------------------------------------------------------------------------
def test_audit_lists_its_controls_and_runs_one_as_the_readme_writes_it(capsys):
    from dp_adam_bench.audit.controls import CONTROLS
    from dp_adam_bench.cli import main

    assert main(["audit", "--list-controls"]) == 0
    listed = [ln.split(":")[0] for ln in capsys.readouterr().out.splitlines()]
    assert listed == list(CONTROLS.names())
    # the control chose Poisson: the privacy_audit table's Poisson schedule comes with it (no train.steps needed)
    assert main(["audit", "--control", "tenth_noise", "--canaries", "200", "--background", "40"]) in (0, 1)
    out = capsys.readouterr().out
    assert "[control tenth_noise]" in out and "100 steps" in out


def test_sweep_plan_says_what_it_is_doing_before_the_slow_part(capsys, monkeypatch):
    from dp_adam_bench import paper_plan
    from dp_adam_bench.cli import main

    def stop(*a, **k):
        raise RuntimeError("stopped before the slow part")  # not Ctrl-C: the CLI turns that into exit 130

    monkeypatch.setattr(paper_plan, "table_plan", stop)
    with pytest.raises(RuntimeError, match="stopped before the slow part"):
        main(["sweep", "ganesh_fig3", "--plan"])
    assert "planning ganesh_fig3" in capsys.readouterr().err
