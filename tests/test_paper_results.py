"""The committed paper-scale results (results/paper/) are what the committed run folders (results/paper/runs/) give,
those folders are still read as the preset's runs (same run ids, nothing missing), and they hold logged runs only."""

import json

import pytest
import yaml

from dp_adam_bench.paths import REPO_ROOT
from dp_adam_bench.report import registry
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.document import build_document
from dp_adam_bench.report.expected import preset_runs
from dp_adam_bench.tracking.run_store import run_id

PAPER = REPO_ROOT / "results" / "paper"
RUNS = PAPER / "runs"
# table id -> (experiment folder under results/paper/runs, runs in it)
TABLES = {"tang_fig1_cifar10": ("tang_fig1_cifar10_paper", 9)}
RUN_FILES = {"config.yaml", "metrics.jsonl", "summary.json"}


@pytest.mark.parametrize("table", sorted(TABLES))
def test_committed_tables_are_what_the_committed_runs_give(table, tmp_path):
    paths = registry.build(table, ReportContext(profile="paper", runs=RUNS, out=tmp_path))
    built = {p.name: p for p in paths}
    assert {f"{table}.md", f"{table}.csv"} <= set(built)
    for name in (f"{table}.md", f"{table}.csv"):
        assert built[name].read_bytes() == (PAPER / name).read_bytes(), name
    # the figure is drawn from the same numbers; its bytes depend on the matplotlib build, so only its presence
    assert (PAPER / f"{table}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"![{table}]({table}.png)" in (PAPER / f"{table}.md").read_text()


@pytest.mark.parametrize("table", sorted(TABLES))
def test_the_committed_runs_are_the_preset_runs(table):
    experiment, n = TABLES[table]
    runs = preset_runs(ReportContext(profile="paper", runs=RUNS), table)
    assert runs.spec.name == experiment
    assert len(runs.complete) == n and not runs.incomplete and not runs.missing
    for record in runs.complete:
        # folders are named by their config alone: a later field in the summaries cannot move them
        assert record.path.name == run_id(record.config), record.path
        assert {p.name for p in record.path.iterdir()} == RUN_FILES, record.path  # no checkpoint, no W&B


def test_the_readme_names_the_right_commit_and_leaves_the_logged_one():
    readme = (RUNS / "tang_fig1_cifar10_paper" / "README.md").read_text()
    assert "019b29cf01bad463d7b7c10dbcac7f6d8418eecc" in readme and "H100" in readme and "175 s" in readme
    commits = {
        json.loads(f.read_text())["git_commit"]
        for f in (RUNS / "tang_fig1_cifar10_paper").glob("*/summary.json")
    }
    assert commits == {"1cfac3e19b39f8ce2523e247d37eea885948d15e"}  # as logged; the README says it is wrong
    assert "1cfac3e19b39f8ce2523e247d37eea885948d15e" in readme
    for cfg in (RUNS / "tang_fig1_cifar10_paper").glob("*/config.yaml"):
        assert yaml.safe_load(cfg.read_text())["profile"] == "paper"


def test_report_md_is_what_the_results_give(tmp_path):
    """results/REPORT.md (with its paper-scale section) is what ``report --document`` writes from results/."""
    import shutil

    copy = tmp_path / "results"
    shutil.copytree(REPO_ROOT / "results", copy)
    build_document(copy)
    assert (copy / "REPORT.md").read_text() == (REPO_ROOT / "results" / "REPORT.md").read_text()
    text = (copy / "REPORT.md").read_text()
    assert "## Paper-scale tables" in text and "[tang_fig1_cifar10](#tang_fig1_cifar10-paper)" in text
    assert "runs: [paper/runs/tang_fig1_cifar10_paper/](paper/runs/tang_fig1_cifar10_paper/)" in text
