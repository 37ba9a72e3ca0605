"""``dp-adam-bench report EXPERIMENT --spec FILE`` (issue 58, dp_adam_bench/report/experiment_spec.py): a YAML
file names the metric, the comparisons and the paper's numbers printed beside ours. Oracles: scipy's Welch test
for each comparison's state in the paper's direction, the paper column against the file, and one line for each
bad file."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml
from scipy import stats as scipy_stats
from test_experiment_report import ctx_for, fake, section

from dp_adam_bench import cli
from dp_adam_bench.report import experiment
from dp_adam_bench.report.experiment_spec import load_spec

LOSSES = {"sgd": (0.1, [0.5, 0.51]), "adam": (0.01, [0.3, 0.31]), "ime": (0.01, [0.7, 0.72])}
PAPER = {
    "source": "Example et al. 2024, Table 1",
    "cells": [
        {"optimizer": "sgd", "value": 0.6},
        {"optimizer": "adam", "value": 0.4},  # the paper: adam below sgd, as ours
        {"optimizer": "ime", "value": 0.5},  # the paper: ime below sgd; ours is above (contradicted)
        {"optimizer": "rmsprop", "value": 0.45},  # no such cell here
    ],
}


def runs(tmp_path):
    for opt, (lr, vals) in LOSSES.items():
        for seed, loss in enumerate(vals):
            fake(tmp_path / "runs", f"{opt}-{seed}", opt=opt, lr=lr, seed=seed, loss=loss)


def write_spec(tmp_path, body) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


def welch(a, b):
    return scipy_stats.ttest_ind(a, b, equal_var=False)


def test_paper_numbers_sit_beside_ours_and_decide_the_direction_of_each_comparison(tmp_path):
    runs(tmp_path)
    spec = load_spec(
        write_spec(tmp_path, {"metric": "test_loss", "baseline": ["optimizer=sgd"], "paper": PAPER})
    )
    experiment.build_experiment("exp", ctx_for(tmp_path), spec=spec)
    table = pd.read_csv(tmp_path / "results" / "exp.csv").set_index("optimizer")
    assert list(table.columns[:5]) == ["test_loss", "test_loss_sample_std", "n", "paper", "ours_minus_paper"]
    assert table.loc["adam", "paper"] == 0.4 and table.loc["ime", "paper"] == 0.5
    assert table.loc["adam", "ours_minus_paper"] == pytest.approx(0.305 - 0.4)
    md = (tmp_path / "results" / "exp.md").read_text()
    lines = section(md, "Against the baseline optimizer=sgd")
    adam = next(ln for ln in lines if ln.startswith("- optimizer=adam < optimizer=sgd (baseline)"))
    g = welch([0.3, 0.31], [0.5, 0.51])
    assert g.pvalue < 0.05 and "**holds**" in adam and "paper: 0.4 vs 0.6" in adam
    # the paper says ime < sgd; ours is decidedly above: the paper's direction is contradicted, not restated
    ime = next(ln for ln in lines if ln.startswith("- optimizer=ime < optimizer=sgd (baseline)"))
    g = welch([0.7, 0.72], [0.5, 0.51])
    assert g.pvalue < 0.05 and "**contradicted**" in ime and "paper: 0.5 vs 0.6" in ime
    assert section(md, "Paper numbers with no cell here (1)") == ["- optimizer=rmsprop: 0.45 (Example et al. 2024, "
                                                                   "Table 1)"]  # fmt: skip
    assert "Paper: Example et al. 2024, Table 1, 3 of its 4 numbers beside 3 cells of ours" in md
    assert "metric `test_loss` (--spec " in md
    assert f"dp-adam-bench report exp --spec {spec.path}`" in md
    assert "the claim is the paper's direction" in md


def test_compare_puts_the_paper_larger_cell_first_and_a_cell_without_a_number_keeps_the_observed_direction(
    tmp_path,
):
    runs(tmp_path)
    body = {"compare": ["optimizer"], "paper": {"source": "Example", "cells": PAPER["cells"][:2]}}
    experiment.build_experiment("exp", ctx_for(tmp_path), spec=load_spec(write_spec(tmp_path, body)))
    lines = section((tmp_path / "results" / "exp.md").read_text(), "Comparisons along optimizer")
    assert any(ln.startswith("- optimizer=sgd > optimizer=adam in test_loss: **holds**") for ln in lines)
    # ime has no paper number: the direction observed, which can only hold or agree
    assert any(ln.startswith("- optimizer=ime > optimizer=sgd in test_loss: **holds**") for ln in lines)
    assert not any("contradicted" in ln for ln in lines)


def test_the_command_lines_metric_wins_and_its_comparisons_add_to_the_files(tmp_path, monkeypatch, capsys):
    runs(tmp_path)
    path = write_spec(tmp_path, {"metric": "test_loss_std", "compare": ["optimizer"]})
    monkeypatch.setenv("DP_ADAM_BENCH_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("DP_ADAM_BENCH_RESULTS", str(tmp_path / "results"))
    assert (
        cli.main(["report", "exp", "--spec", path, "--metric", "test_loss", "--baseline", "optimizer=sgd"])
        == 0
    )
    md = (tmp_path / "results" / "exp.md").read_text()
    assert (
        "## Comparisons along optimizer (test_loss)" in md and "## Against the baseline optimizer=sgd" in md
    )
    assert f"dp-adam-bench report exp --spec {path} --metric test_loss --baseline optimizer=sgd" in md


@pytest.mark.parametrize(
    "body, message",
    [
        ({"metrics": "x"}, "unknown key 'metrics'; valid: metric, compare, baseline, paper"),
        ({"compare": [1]}, r"compare = \[1\]: give a list of strings"),
        ({"paper": {"cells": [{"optimizer": "sgd", "value": 1.0}]}}, "paper.source: say where the paper's"),
        (
            {"paper": {"source": "x", "cells": [{"optimizer": "sgd", "value": ".nan"}]}},
            r"paper.cells\[0\].value",
        ),
        ({"paper": {"source": "x", "cells": [{"value": 1.0}]}}, "name the cell by at least one key"),
        ({"paper": {"source": "x", "table": 2}}, "unknown key paper.table; valid: source, cells"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_key(tmp_path, body, message):
    text = yaml.safe_dump(body).replace("'.nan'", ".nan")  # a YAML NaN, not the string
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_spec(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_paper_cell_on_a_key_that_does_not_vary_or_naming_a_cell_twice_is_refused(tmp_path):
    runs(tmp_path)
    body = {"paper": {"source": "x", "cells": [{"task": "toy", "value": 1.0}]}}
    with pytest.raises(
        ValueError, match=r"paper.cells\[0\]: 'task' does not vary across the runs; the keys that"
    ):
        experiment.build_experiment("exp", ctx_for(tmp_path), spec=load_spec(write_spec(tmp_path, body)))
    body = {
        "paper": {
            "source": "x",
            "cells": [{"optimizer": "sgd", "value": 1.0}, {"optimizer.lr": 0.1, "value": 2.0}],
        }
    }
    with pytest.raises(
        ValueError, match=r"cells\[1\] \(optimizer.lr=0.1\) names the cell optimizer=sgd optimizer.lr=0.1"
    ):
        experiment.build_experiment("exp", ctx_for(tmp_path), spec=load_spec(write_spec(tmp_path, body)))


def test_spec_is_refused_for_a_registry_table(isolated_dirs, tmp_path, capsys):
    path = write_spec(tmp_path, {"metric": "test_loss"})
    assert cli.main(["report", "ganesh_quadratic", "--spec", path]) == 2
    assert "--spec are for an experiment's runs, not table 'ganesh_quadratic'" in capsys.readouterr().err


def readme_spec_example() -> tuple[list[str], str, list[str]]:
    """The README's ``--spec`` example: the sweep's arguments, the spec file's text, the report's arguments."""
    import shlex

    from dp_adam_bench.paths import REPO_ROOT

    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("**Paper numbers beside yours.**") :]
    block = section[section.index("```bash\n") + len("```bash\n") : section.index("\n```\n")]
    heredoc = block[block.index("<<'YAML'\n") + len("<<'YAML'\n") : block.index("\nYAML\n")]
    sweep_line, report_line = block.splitlines()[0], block.splitlines()[-1]
    return shlex.split(sweep_line)[1:], heredoc, shlex.split(report_line)[1:]


@pytest.mark.slow
def test_the_readme_spec_example_runs_and_judges_in_the_papers_direction(tmp_path):
    """The README's commands as written (sweep, spec file, report): the paper numbers in the table, and the one
    comparison in the paper's direction with the state scipy's Welch test of the runs' own summaries gives."""
    import json
    import os
    import subprocess
    import sys

    sweep_args, spec_text, report_args = readme_spec_example()
    assert sweep_args[:2] == ["sweep", "fig2_mine"] and report_args == [
        "report",
        "fig2_mine",
        "--spec",
        "fig2.yaml",
    ]
    env = {
        **os.environ,
        "DP_ADAM_BENCH_RUNS": str(tmp_path / "runs"),
        "DP_ADAM_BENCH_RESULTS": str(tmp_path / "results"),
        "DP_ADAM_BENCH_PROGRESS": "off",
        "WANDB_MODE": "disabled",
    }
    for args in (sweep_args, None, report_args):
        if args is None:
            (tmp_path / "fig2.yaml").write_text(spec_text)
            continue
        done = subprocess.run(
            [sys.executable, "-m", "dp_adam_bench", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    losses: dict[str, list[float]] = {}
    for path in (tmp_path / "runs" / "fig2_mine").glob("*/summary.json"):
        s = json.loads(path.read_text())
        losses.setdefault(path.parent.name.split("-")[0], []).append(s["metrics"]["test_loss"])
    assert sorted(losses) == ["adagrad_ime", "adagrad_pp"] and all(len(v) == 2 for v in losses.values())
    table = pd.read_csv(tmp_path / "results" / "fig2_mine.csv").set_index("optimizer")
    assert table.loc["adagrad_pp", "paper"] == 0.6010 and table.loc["adagrad_ime", "paper"] == 0.5981
    g = welch(losses["adagrad_pp"], losses["adagrad_ime"])  # the paper's direction: pp above ime
    want = (
        ("holds" if g.statistic > 0 else "contradicted")
        if g.pvalue < 0.05
        else ("agrees, not decided" if g.statistic > 0 else "disagrees, not decided")
    )
    md = (tmp_path / "results" / "fig2_mine.md").read_text()
    assert f"- optimizer=adagrad_pp > optimizer=adagrad_ime in test_loss: **{want}**" in md
