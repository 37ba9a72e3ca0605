"""Report aggregation on synthetic run folders: selection rule, incomplete runs excluded and listed."""

import json

import pandas as pd
import pytest
import yaml

from dp_adam_bench.report import ganesh_fig2
from dp_adam_bench.report.aggregate import select_best, split_complete
from dp_adam_bench.tracking.run_store import load_runs


def fake_run(root, name, opt, noise, lr, trials, complete=True, gt=0.6):
    folder = root / "ganesh_fig2" / name
    folder.mkdir(parents=True)
    cfg = {
        "optimizer": {"name": opt, "lr": lr},
        "noise": {"kind": noise},
        "privacy": {"delta": 1e-5},
        "seed": 0,
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    if complete:
        summary = {
            "status": "complete",
            "metrics": {"test_loss": sum(trials) / len(trials)},
            "trials": {"test_loss": trials},
            "ground_truth": gt,
            "n_trials": len(trials),
            "epsilon": {"pld": 50.0},
        }
        (folder / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def store(isolated_dirs):
    root = isolated_dirs / "runs"
    fake_run(root, "np", "adagrad_pp", "none", 1.0, [0.601])
    fake_run(root, "np2", "adagrad_pp", "none", 0.1, [0.650])
    for noise in ("dpmf_sqrt", "independent"):
        fake_run(root, f"pp-a-{noise}", "adagrad_pp", noise, 0.1, [0.62, 0.64])
        fake_run(root, f"pp-b-{noise}", "adagrad_pp", noise, 1.0, [0.605, 0.607])
        fake_run(root, f"ime-{noise}", "adagrad_ime", noise, 1.0, [0.602, 0.604])
        fake_run(root, f"imef-{noise}", "adagrad_ime_free", noise, 1.0, [0.603, 0.603])
    # an incomplete run that would win if it were (wrongly) aggregated
    fake_run(root, "broken", "adagrad_ime", "dpmf_sqrt", 3.0, [0.1], complete=False)
    return isolated_dirs


def test_select_best_picks_lowest_mean_and_ignores_incomplete(store):
    records = load_runs(store / "runs", "ganesh_fig2")
    complete, incomplete = split_complete(records)
    assert [r.path.name for r in incomplete] == ["broken"]
    cells = select_best(records, per=["optimizer", "noise"], tuned=["optimizer.lr"], metric="test_loss")
    pp = cells[("adagrad_pp", "dpmf_sqrt")]
    assert pp.chosen == {"optimizer.lr": 1.0} and pp.mean == pytest.approx(0.606) and pp.n == 2
    assert cells[("adagrad_ime", "dpmf_sqrt")].chosen == {"optimizer.lr": 1.0}
    assert len(pp.candidates) == 2


def test_ganesh_fig2_report_writes_table_claims_and_figure(store):
    paths = ganesh_fig2.build()
    names = sorted(p.name for p in paths)
    assert names == ["ganesh_fig2.csv", "ganesh_fig2.md", "ganesh_fig2.png"]
    df = pd.read_csv(store / "results" / "ganesh_fig2.csv")
    assert {"row", "column", "paper", "ours", "ours_std", "n"} <= set(df.columns)
    assert set(df.row) == {"ground_truth", "nonprivate", "postprocessing", "ime", "ime_free"}
    assert set(df.column) == {"dpmf", "independent"}
    ime = df[(df.row == "ime") & (df.column == "dpmf")].iloc[0]
    assert ime.paper == pytest.approx(0.5981) and ime.ours == pytest.approx(0.603)
    assert df[df.column == "independent"].paper.isna().all()
    md = (store / "results" / "ganesh_fig2.md").read_text()
    assert "Regenerate: `make reproduce-table TABLE=ganesh_fig2`" in md
    assert "IME beats post-processing (dpmf noise): **holds**" in md
    assert "non-private AdaGrad reaches the ground-truth loss (within 0.001): **does not hold**" in md
    assert "Incomplete runs left out: broken" in md


def test_report_without_runs_says_what_to_run(isolated_dirs):
    with pytest.raises(FileNotFoundError, match="dp-adam-bench sweep ganesh_fig2"):
        ganesh_fig2.build()


def fake_cifar_run(root, name, opt, seed, final, complete=True):
    folder = root / "tang_fig1_cifar10_cpu" / name
    folder.mkdir(parents=True)
    cfg = {
        "optimizer": {"name": opt, "lr": 0.001},
        "noise": {"kind": "independent"},
        "seed": seed,
        "privacy": {"clip": 1.0, "sigma": 1.0, "delta": 1e-5},
        "train": {"batch_size": 1024, "clipping": "ghost"},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": s, "test_accuracy": final * s / 20, "epsilon": 0.1 * s} for s in (10, 20)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if complete:
        summary = {
            "status": "complete",
            "metrics": {"test_accuracy": final},
            "steps": 20,
            "epsilon": {"rdp": 2.0},
        }
        (folder / "summary.json").write_text(json.dumps(summary))


def test_tang_fig1_report_means_over_seeds_and_checks_claims(isolated_dirs):
    from dp_adam_bench.report import tang_fig1_cifar10

    root = isolated_dirs / "runs"
    for seed, (s, a, bc) in enumerate([(40.0, 30.0, 35.0), (42.0, 32.0, 37.0), (41.0, 31.0, 36.0)]):
        fake_cifar_run(root, f"sgd{seed}", "sgd", seed, s)
        fake_cifar_run(root, f"adam{seed}", "adam", seed, a)
        fake_cifar_run(root, f"bc{seed}", "adambc", seed, bc)
    fake_cifar_run(root, "killed", "adam", 9, 99.0, complete=False)
    tang_fig1_cifar10.build("cpu")
    df = pd.read_csv(isolated_dirs / "results" / "tang_fig1_cifar10.csv")
    sgd = df[df.row == "sgd"].iloc[0]
    assert sgd.ours == pytest.approx(41.0) and sgd.ours_std == pytest.approx(1.0) and sgd.n == 3
    assert sgd.paper == pytest.approx(61.94)
    md = (isolated_dirs / "results" / "tang_fig1_cifar10.md").read_text()
    assert "DP-AdamBC > DP-Adam-Biased: **holds**" in md
    assert "DP-SGD >= DP-AdamBC: **holds**" in md
    assert "Incomplete runs left out: killed" in md
    assert (isolated_dirs / "results" / "tang_fig1_cifar10.png").exists()


def test_tang_fig1_report_repeats_the_runs_privacy_notes(isolated_dirs):
    from dp_adam_bench.report import tang_fig1_cifar10

    root = isolated_dirs / "runs"
    fake_cifar_run(root, "sgd0", "sgd", 0, 40.0)
    summary_file = root / "tang_fig1_cifar10_cpu" / "sgd0" / "summary.json"
    summary = json.loads(summary_file.read_text())
    summary["privacy_notes"] = [
        "fixed-size shuffled batches: accounted as Poisson sampling (not DP-faithful)"
    ]
    summary_file.write_text(json.dumps(summary))
    tang_fig1_cifar10.build("cpu")
    md = (isolated_dirs / "results" / "tang_fig1_cifar10.md").read_text()
    assert "From the run folders: fixed-size shuffled batches" in md


def test_report_document_collects_every_claim(isolated_dirs):
    from dp_adam_bench.report.document import build_document, claims_of

    md = (
        "# T\n\nRegenerate: `make x`\n\n## Paper claims checked here\n\n- a > b: **holds** (1 vs 0)\n"
        "- c: **does not hold**\n\n## Notes\n\n- not a claim: **holds**\n"
    )
    assert claims_of(md) == [("a > b", "holds", "1 vs 0"), ("c", "does not hold", "")]
    res = isolated_dirs / "results"
    res.mkdir()
    (res / "ganesh_fig2.md").write_text(md)
    (res / "paper").mkdir()
    (res / "paper" / "ganesh_fig2.md").write_text(
        md.replace("(1 vs 0)", "(2 vs 0)") + "\n![f](ganesh_fig2.png)\n"
    )
    text = build_document().read_text()
    assert "| [ganesh_fig2](#ganesh_fig2-cpu) | cpu | a > b | **holds** | 1 vs 0 |" in text
    assert "| [ganesh_fig2](#ganesh_fig2-paper) | paper | a > b | **holds** | 2 vs 0 |" in text
    assert "![f](paper/ganesh_fig2.png)" in text  # a paper-profile figure is linked from results/paper/
    assert "2 claims hold, 2 do not." in text
    assert "Not generated yet:" in text and "`tang_budget`" in text


def test_paper_profile_tables_go_to_their_own_folder(isolated_dirs, monkeypatch):
    from dp_adam_bench.report import registry

    seen = {}

    def fake_build(profile):
        from dp_adam_bench.paths import results_dir

        seen[profile] = results_dir()
        return []

    monkeypatch.setattr(ganesh_fig2, "build", fake_build)
    registry.build("ganesh_fig2", "paper")
    registry.build("ganesh_fig2", "cpu")
    assert seen == {"paper": isolated_dirs / "results" / "paper", "cpu": isolated_dirs / "results"}


def test_runs_outside_the_current_preset_are_set_aside_not_deleted(isolated_dirs):
    from dp_adam_bench.sweep import expected_runs, set_aside_stale_runs

    name, ids = expected_runs("ganesh_fig2", "cpu")
    assert name == "ganesh_fig2" and len(ids) == 7 * 13  # 7 (optimizer, noise) pairs x 13 learning rates
    root = isolated_dirs / "runs"
    keep = sorted(ids)[0]
    fake_run(root, keep, "adagrad_pp", "none", 1.0, [0.6])
    fake_run(root, "adagrad_pp-none-lr0.01-s0-oldgrid0", "adagrad_pp", "none", 0.01, [0.7])
    moved = set_aside_stale_runs("ganesh_fig2", "cpu")
    assert [m.name for m in moved] == ["adagrad_pp-none-lr0.01-s0-oldgrid0"]
    assert (root / "ganesh_fig2" / "_stale" / "adagrad_pp-none-lr0.01-s0-oldgrid0" / "summary.json").exists()
    assert [r.path.name for r in load_runs(root, "ganesh_fig2")] == [keep]
