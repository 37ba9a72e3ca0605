"""Re-stating a committed table under the shared rule (dp_adam_bench/report/restate.py) gives what the builder
writes from the runs: the claims read only the table's cells, so the CSV is enough.

The fixtures under tests/data/restate/ are tables written by the builders *before* the shared rule (commit 382cf8b,
population or sample stds named ``std``, the "> 2 SE" rule) from the fake runs the tests below make; re-stating
them must give the bytes the new builder writes from the same runs, plus the one note that says so.
"""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from scipy import stats

from dp_adam_bench.report import expected, registry
from dp_adam_bench.report.restate import RESTATED, parse_markdown, restate

DATA = Path(__file__).parent / "data" / "restate"


@pytest.fixture
def all_expected(monkeypatch):
    """For a synthetic store that is not the preset's full sweep: no expected run counts as missing."""
    monkeypatch.setattr(expected, "missing_runs", lambda spec, complete: [])


def tang_fig1_runs(root: Path) -> None:
    """Three optimizers x three seeds of tang_fig1_cifar10: one ordering decided, one not."""
    finals = {"sgd": (41.0, 43.5, 40.2), "adam": (30.1, 32.0, 31.0), "adambc": (35.0, 39.9, 36.1)}
    for opt, accs in finals.items():
        for seed, acc in enumerate(accs):
            folder = root / "tang_fig1_cifar10_cpu" / f"{opt}{seed}"
            folder.mkdir(parents=True)
            cfg = {
                "optimizer": {"name": opt, "lr": {"sgd": 4.0}.get(opt, 0.001)},
                "noise": {"kind": "independent"},
                "seed": seed,
                "privacy": {"clip": 1.0, "sigma": 1.0, "delta": 1e-5},
                "train": {"batch_size": 1024, "clipping": "ghost"},
            }
            (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
            rows = [{"step": s, "test_accuracy": acc * s / 20, "epsilon": 0.1 * s} for s in (10, 20)]
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            summary = {
                "status": "complete",
                "metrics": {"test_accuracy": acc},
                "steps": 20,
                "epsilon": {"rdp": 2.0},
            }
            (folder / "summary.json").write_text(json.dumps(summary))


def _with_restated_note(md: str, table: str) -> str:
    """``md`` with the note :func:`restate` adds last."""
    return md.rstrip("\n") + f"\n- {RESTATED.format(table=table)}\n"


def _restated(src: Path, table: str, tmp: Path) -> dict[str, str]:
    out = tmp / "restated"
    out.mkdir(parents=True)
    for ext in ("csv", "md"):
        shutil.copy(src / f"{table}.{ext}", out)
    restate(table, out)
    return {ext: (out / f"{table}.{ext}").read_text() for ext in ("csv", "md")}


def test_restating_an_old_table_gives_what_the_builder_writes_from_its_runs(isolated_dirs, all_expected):
    tang_fig1_runs(isolated_dirs / "runs")
    registry.build("tang_fig1_cifar10")
    built = isolated_dirs / "results"
    new = {ext: (built / f"tang_fig1_cifar10.{ext}").read_text() for ext in ("csv", "md")}
    old = _restated(DATA, "tang_fig1_cifar10", isolated_dirs)
    assert old["csv"] == new["csv"]
    assert old["md"] == _with_restated_note(new["md"], "tang_fig1_cifar10")
    # the old table called DP-SGD - DP-AdamBC "+2.6 standard errors" (beyond noise by its > 2 SE rule); by
    # Welch's t (scipy's, the oracle) on 3.5 degrees of freedom it is p = 0.07: the seeds do not decide it
    assert (
        "+2.6 standard errors over 3 / 3 seeds; paper margin +1.67)"
        in (DATA / "tang_fig1_cifar10.md").read_text()
    )
    sgd_bc = stats.ttest_ind([41.0, 43.5, 40.2], [35.0, 39.9, 36.1], equal_var=False)
    assert (
        f"DP-SGD >= DP-AdamBC: **holds** (41.57 vs 37.00 %, margin +4.57; t = {sgd_bc.statistic:+.2f} (Welch, "
        f"df {sgd_bc.df:.1f}), p = {sgd_bc.pvalue:.2g} over 3 / 3 seeds; paper: margin +1.67; WITHIN SEED NOISE"
    ) in old["md"]
    bc_adam = stats.ttest_ind([35.0, 39.9, 36.1], [30.1, 32.0, 31.0], equal_var=False)
    assert (
        bc_adam.pvalue < 0.05
        and f"p = {bc_adam.pvalue:.2g} over 3 / 3 seeds; paper: margin +3.92)" in old["md"]
    )


def test_restating_twice_changes_nothing(isolated_dirs, all_expected):
    tang_fig1_runs(isolated_dirs / "runs")
    registry.build("tang_fig1_cifar10")
    once = _restated(isolated_dirs / "results", "tang_fig1_cifar10", isolated_dirs / "a")
    (isolated_dirs / "b").mkdir()
    for ext, text in once.items():
        (isolated_dirs / "b" / f"tang_fig1_cifar10.{ext}").write_text(text)
    assert _restated(isolated_dirs / "b", "tang_fig1_cifar10", isolated_dirs / "c") == once


@pytest.mark.parametrize("table", ["tang_fig1_cifar10", "tang_fig1_snli"])
def test_the_committed_tables_parse_back_into_what_wrote_them(table):
    """The committed md is one write_table wrote: parsed and re-stated, it keeps its title, setting and notes."""
    results = Path(__file__).parents[1] / "results"
    md = parse_markdown((results / f"{table}.md").read_text())
    assert md.title.startswith("Tang & Lecuyer Fig. 1") and md.setting and md.claims and md.notes
    assert md.figure == f"![{table}]({table}.png)"


def test_a_table_without_a_restatement_is_refused_naming_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="has no restatement; valid: .*tang_fig1_cifar10"):
        restate("privacy_audit", tmp_path)
