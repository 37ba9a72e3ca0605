"""The W&B dashboard of an experiment that is not a preset (issue 58): a grid run under a name of one's own gets the
workspace the presets get, its line panels split along the keys the report splits its cells by
(``dp-adam-bench report NAME``, :mod:`dp_adam_bench.report.experiment`), one panel per key (W&B groups a panel by
one key)."""

from __future__ import annotations

from test_experiment_report import fake

from dp_adam_bench.cli import main
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.experiment import canonical, find_runs, group_cells, label_keys
from dp_adam_bench.tracking import wandb_dashboard as dash


def _grid(root):
    """A 2 x 2 grid (optimizer x noise kind) of two seeds a cell; the lr follows the optimizer."""
    for opt, lr in (("sgd", 0.1), ("adam", 0.001)):
        for kind in ("independent", "dpmf"):
            for seed in (0, 1):
                fake(root, f"{opt}-{kind}-{seed}", opt=opt, lr=lr, seed=seed, extra={"noise": {"kind": kind}})


def test_an_ad_hoc_experiment_is_grouped_as_its_report_splits_it(isolated_dirs, capsys):
    _grid(isolated_dirs / "runs")
    varying, cells = group_cells(find_runs(ReportContext(), "exp"), "test_loss")
    keys = label_keys(varying, [tuple(canonical(c.values[k]) for k in varying) for c in cells])
    assert set(varying) == {"optimizer.name", "optimizer.lr", "noise.kind"} and len(cells) == 4
    assert set(keys) == {"optimizer.name", "noise.kind"}  # the report's columns: the lr follows the optimizer
    (info,) = dash.experiment_info(["exp"])
    assert info == {
        "experiment": "exp",
        "group": "exp",
        "metric": "test_loss",
        "groupby": [f"config.{k}" for k in keys],
    }
    (plan,) = dash.dashboard_plan(dash.load_spec(), [info])
    panels = [p for s in plan["sections"] for p in s["panels"]]
    by_config = [p for p in panels if str(p.get("groupby", "")).startswith("config.")]
    assert sorted(p["groupby"] for p in by_config) == sorted(f"config.{k}" for k in keys)
    assert {p["title"] for p in by_config} == {
        "test_loss vs step, by optimizer",
        "test_loss vs step, by noise",
    }
    # the panels grouped by a run attribute are the presets' own
    (preset,) = dash.dashboard_plan(dash.load_spec(), dash.experiment_info(["ganesh_quadratic"]))
    attrs = [
        p
        for s in preset["sections"]
        for p in s["panels"]
        if not str(p.get("groupby", "")).startswith("config.")
    ]
    assert len([p for p in panels if p not in by_config]) == len(attrs)

    assert main(["wandb-dashboard", "--project", "e/p", "--experiment", "exp", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "runs: W&B group = 'exp' (the run store's runs of exp, metric test_loss)" in out
    assert "grouped by config.noise.kind" in out and "grouped by config.optimizer.name" in out


def test_a_preset_plan_is_unchanged_and_names_its_preset(isolated_dirs, capsys):
    (info,) = dash.experiment_info(["ganesh_quadratic"])
    assert "groupby" not in info
    assert main(["wandb-dashboard", "--project", "e/p", "--experiment", "ganesh_quadratic", "--dry-run"]) == 0
    assert "(preset ganesh_quadratic, metric" in capsys.readouterr().out


def test_a_name_that_is_neither_a_preset_nor_runs_is_one_line(isolated_dirs, capsys):
    assert main(["wandb-dashboard", "--project", "e/p", "--experiment", "nope", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unknown experiment 'nope': not a preset, and no runs of an experiment of that name" in err
