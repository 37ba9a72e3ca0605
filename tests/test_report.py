"""Report aggregation on synthetic run folders: selection rule, incomplete runs excluded and listed, claims
incomplete while runs the preset expects are missing."""

import json
import math
import statistics

import pandas as pd
import pytest
import yaml
from scipy import stats

from dp_adam_bench.report import expected, ganesh_fig2, registry
from dp_adam_bench.report.aggregate import select_best, split_complete
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.sweep import sweep_spec
from dp_adam_bench.tracking.run_store import load_local_runs


@pytest.fixture
def all_expected(monkeypatch):
    """For a synthetic store that is not the preset's full sweep: no expected run counts as missing."""
    monkeypatch.setattr(expected, "missing_runs", lambda spec, complete: [])


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
    records = load_local_runs(store / "runs", "ganesh_fig2")
    complete, incomplete = split_complete(records)
    assert [r.path.name for r in incomplete] == ["broken"]
    cells = select_best(records, per=["optimizer", "noise"], tuned=["optimizer.lr"], metric="test_loss")
    pp = cells[("adagrad_pp", "dpmf_sqrt")]
    assert pp.chosen == {"optimizer.lr": 1.0} and pp.mean == pytest.approx(0.606) and pp.n == 2
    assert pp.std == pytest.approx(statistics.stdev([0.605, 0.607]))  # the sample std (ddof = 1)
    assert cells[("adagrad_ime", "dpmf_sqrt")].chosen == {"optimizer.lr": 1.0}
    assert len(pp.candidates) == 2


def test_ganesh_fig2_report_writes_table_claims_and_figure(store, all_expected):
    paths = ganesh_fig2.build()
    names = sorted(p.name for p in paths)
    assert names == ["ganesh_fig2.csv", "ganesh_fig2.md", "ganesh_fig2.png"]
    df = pd.read_csv(store / "results" / "ganesh_fig2.csv")
    assert {"row", "column", "paper", "ours", "ours_sample_std", "n"} <= set(df.columns)
    assert set(df.row) == {"ground_truth", "nonprivate", "postprocessing", "ime", "ime_free"}
    assert set(df.column) == {"dpmf", "independent"}
    ime = df[(df.row == "ime") & (df.column == "dpmf")].iloc[0]
    assert ime.paper == pytest.approx(0.5981) and ime.ours == pytest.approx(0.603)
    assert df[df.column == "independent"].paper.isna().all()
    md = (store / "results" / "ganesh_fig2.md").read_text()
    assert "Regenerate: `make reproduce-table TABLE=ganesh_fig2`" in md
    # IME 0.603 vs post-processing 0.606 over 2 / 2 trials: the right order, but Welch's t (scipy's, the oracle)
    # does not decide it: it agrees, not decided, and says how many trials would
    # t > 0 in the paper's order: post-processing's loss minus IME's
    welch = stats.ttest_ind([0.605, 0.607], [0.602, 0.604], equal_var=False)
    assert welch.pvalue >= 0.05
    assert (
        "IME beats post-processing (dpmf noise): **agrees, not decided** (0.6030 vs 0.6060, margin +0.0030; "
        f"t = {welch.statistic:+.2f} (Welch, df {welch.df:.1f}), p = {welch.pvalue:.2g} over 2 / 2 trials; "
        f"not decided: p = {welch.pvalue:.2g} >= 0.05 by Welch's t;"
    ) in md
    # each cell's learning rate is chosen on the trials the test reads: said, and never decided by them
    assert (
        "not an independent test: each cell's learning rate is the best of its grid on these very trials"
        in md
    )
    assert "**holds**" not in md
    # the non-private run is exact (no noise): it differs from the ground truth by more than the stated tolerance
    assert "non-private AdaGrad reaches the ground-truth loss (within 0.001): **differs** (" in md
    assert "exact: the non-private run adds no noise" in md
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


def test_tang_fig1_report_means_over_seeds_and_checks_claims(isolated_dirs, all_expected):
    root = isolated_dirs / "runs"
    for seed, (s, a, bc) in enumerate([(40.0, 30.0, 35.0), (42.0, 32.0, 37.0), (41.0, 31.0, 36.0)]):
        fake_cifar_run(root, f"sgd{seed}", "sgd", seed, s)
        fake_cifar_run(root, f"adam{seed}", "adam", seed, a)
        fake_cifar_run(root, f"bc{seed}", "adambc", seed, bc)
    fake_cifar_run(root, "killed", "adam", 9, 99.0, complete=False)
    registry.build("tang_fig1_cifar10")
    df = pd.read_csv(isolated_dirs / "results" / "tang_fig1_cifar10.csv")
    sgd = df[df.row == "sgd"].iloc[0]
    assert sgd.ours == pytest.approx(41.0) and sgd.ours_sample_std == pytest.approx(1.0) and sgd.n == 3
    assert sgd.paper == pytest.approx(61.94)
    md = (isolated_dirs / "results" / "tang_fig1_cifar10.md").read_text()
    assert "DP-AdamBC > DP-Adam-Biased: **holds**" in md
    assert "DP-SGD >= DP-AdamBC: **holds**" in md
    assert "Incomplete runs left out: killed" in md
    assert (isolated_dirs / "results" / "tang_fig1_cifar10.png").exists()


def test_tang_fig1_report_repeats_the_runs_privacy_notes(isolated_dirs, all_expected):
    root = isolated_dirs / "runs"
    fake_cifar_run(root, "sgd0", "sgd", 0, 40.0)
    summary_file = root / "tang_fig1_cifar10_cpu" / "sgd0" / "summary.json"
    summary = json.loads(summary_file.read_text())
    summary["privacy_notes"] = [
        "fixed-size shuffled batches: accounted as Poisson sampling (not DP-faithful)"
    ]
    summary_file.write_text(json.dumps(summary))
    registry.build("tang_fig1_cifar10", ReportContext(profile="cpu"))
    md = (isolated_dirs / "results" / "tang_fig1_cifar10.md").read_text()
    assert "From the run folders: fixed-size shuffled batches" in md


def test_report_document_collects_every_claim(isolated_dirs):
    from dp_adam_bench.report.document import build_document, claims_of

    md = (
        "# T\n\nRegenerate: `make x`\n\n## Paper claims checked here\n\n- a > b: **holds** (1 vs 0)\n"
        "- c: **disagrees, not decided**\n- d: **matches** (exact)\n- e: **untested**\n\n## Notes\n\n"
        "- not a claim: **holds**\n"
    )
    assert claims_of(md) == [
        ("a > b", "holds", "1 vs 0"),
        ("c", "disagrees, not decided", ""),
        ("d", "matches", "exact"),
        ("e", "untested", ""),
    ]
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
    # the summary counts each state per table and profile, then in all
    assert (
        "| table | profile | holds | agrees, not decided | disagrees, not decided | contradicted | untested | "
        "matches | differs | not checked |" in text
    )
    assert "| [ganesh_fig2](#ganesh_fig2-cpu) | cpu | 1 | 0 | 1 | 0 | 1 | 1 | 0 | 0 |" in text
    assert "| [ganesh_fig2](#ganesh_fig2-paper) | paper | 1 | 0 | 1 | 0 | 1 | 1 | 0 | 0 |" in text
    assert "| **all** | | **2** | **0** | **2** | **0** | **2** | **2** | **0** | **0** |" in text
    assert "Totals: 2 holds, 2 disagrees, not decided, 2 untested, 2 matches." in text
    assert text.index("Claims per table and state:") < text.index("Every claim:")
    assert "Not generated yet:" in text and "`tang_budget`" in text


def test_paper_profile_tables_go_to_their_own_folder(isolated_dirs, monkeypatch, tmp_path):
    seen = {}

    def fake_build(ctx):
        seen[ctx.profile] = ctx.out
        return []

    monkeypatch.setattr(ganesh_fig2, "build", fake_build)
    registry.build("ganesh_fig2", ReportContext(profile="paper"))
    registry.build("ganesh_fig2", ReportContext(profile="cpu"))
    assert seen == {"paper": isolated_dirs / "results" / "paper", "cpu": isolated_dirs / "results"}
    # the context, not the environment, says where: another folder, and an exact table goes to the folder itself
    registry.build("ganesh_fig2", ReportContext(profile="paper", out=tmp_path / "elsewhere"))
    assert seen["paper"] == tmp_path / "elsewhere" / "paper"
    assert not (isolated_dirs / "results").exists()


def test_every_table_names_a_build_function_and_bad_names_fail_clearly():
    for tid in registry.GROUPS["all"]:
        spec = registry.spec(tid)
        assert callable(spec.function()), tid
    assert sorted(registry.GROUPS["all"]) == list(registry.REPORTS.names())
    with pytest.raises(
        ValueError, match=r"table='tang_fig9' is not a known table; valid: chooi_dpadamw, ganesh_fig2"
    ):
        registry.spec("tang_fig9")
    with pytest.raises(ValueError, match=r"run source 'cloud' is not one of: local, wandb, both"):
        ReportContext(source="cloud")
    with pytest.raises(ValueError, match=r"profile 'gpu' is not one of: cpu, paper"):
        ReportContext(profile="gpu")


@pytest.mark.slow
def test_runs_outside_the_current_preset_are_set_aside_not_deleted(isolated_dirs, monkeypatch):
    from dp_adam_bench import sweep
    from dp_adam_bench.sweep import expected_runs, set_aside_stale_runs

    name, ids = expected_runs("ganesh_fig2", "cpu")
    assert name == "ganesh_fig2" and len(ids) == 7 * 13  # 7 (optimizer, noise) pairs x 13 learning rates
    # set_aside_stale_runs takes these same ids (composing the 91 configs again takes ~8 s on 2 cores)
    monkeypatch.setattr(sweep, "expected_runs", lambda experiment, profile: (name, set(ids)))
    root = isolated_dirs / "runs"
    keep = sorted(ids)[0]
    fake_run(root, keep, "adagrad_pp", "none", 1.0, [0.6])
    fake_run(root, "adagrad_pp-none-lr0.01-s0-oldgrid0", "adagrad_pp", "none", 0.01, [0.7])
    moved = set_aside_stale_runs("ganesh_fig2", "cpu")
    assert [m.name for m in moved] == ["adagrad_pp-none-lr0.01-s0-oldgrid0"]
    assert (root / "ganesh_fig2" / "_stale" / "adagrad_pp-none-lr0.01-s0-oldgrid0" / "summary.json").exists()
    assert [r.path.name for r in load_local_runs(root, "ganesh_fig2")] == [keep]


# --------------------------------------------------------------------------- a report while its sweep runs


FIG2_BASE = {  # (optimizer, noise kind) -> final test loss at lr = 1 (the best lr: the loss grows away from it)
    ("adagrad_pp", "none"): 0.601,
    ("adagrad_pp", "dpmf_sqrt"): 0.606,
    ("adagrad_ime", "dpmf_sqrt"): 0.603,
    ("adagrad_ime_free", "dpmf_sqrt"): 0.6035,
    ("adagrad_pp", "independent"): 0.607,
    ("adagrad_ime", "independent"): 0.604,
    ("adagrad_ime_free", "independent"): 0.605,
}


def fig2_point_run(root, point):
    opt, noise, lr = point["optimizer"], point["noise"], point["optimizer.lr"]
    loss = FIG2_BASE[(opt, noise)] + 0.01 * abs(math.log10(lr))
    fake_run(root, f"{opt}-{noise}-lr{lr:g}", opt, noise, lr, [loss - 0.001, loss + 0.001])


def fig2_claims(md):
    return [line for line in md.split("## Paper claims checked here")[1].split("##")[0].splitlines() if line]


def test_a_report_of_a_running_sweep_says_incomplete_and_lists_every_missing_run(isolated_dirs):
    """The sweep is still running: every run of one cell (IME, dpmf noise) and two others are missing, one of
    them in flight (a folder without summary). No claim may say 'does not hold' on the empty cell's NaN; every
    claim is incomplete, and every missing run is listed, not only the one in flight."""
    root = isolated_dirs / "runs"
    points = sweep_spec("ganesh_fig2", "cpu").points()
    assert len(points) == 91
    lacking = [p for p in points if (p["optimizer"], p["noise"]) == ("adagrad_ime", "dpmf_sqrt")]
    lacking += [points[0], points[-1]]
    for p in points:
        if p not in lacking:
            fig2_point_run(root, p)
    fake_run(root, "in-flight", "adagrad_ime", "dpmf_sqrt", 1.0, [0.6], complete=False)

    ganesh_fig2.build(ReportContext())
    md = (isolated_dirs / "results" / "ganesh_fig2.md").read_text()
    claims = fig2_claims(md)
    assert len(claims) == 5  # ground truth; IME and IME for free vs post-processing, in each column
    assert all(": **incomplete** (15 expected runs missing; so far: " in c for c in claims), claims
    assert (
        "- IME beats post-processing (dpmf noise): **incomplete** (15 expected runs missing; so far: no test: no "
        "finite result for IME)" in claims
    )
    assert "does not hold" not in md and "nan" not in md.split("## Notes")[0].lower()
    section = md.split("## Missing runs (15: the claims above are incomplete until they are complete)")[1]
    listed = [line for line in section.split("##")[0].splitlines() if line.startswith("- `")]
    assert listed == [f"- `{expected.point_text(p)}`" for p in points if p in lacking]
    assert "- `optimizer=adagrad_ime noise=dpmf_sqrt optimizer.lr=0.0316`" in listed
    assert "Incomplete runs left out: in-flight" in md

    # the sweep finishes: the same report checks every claim
    for p in lacking:
        fig2_point_run(root, p)
    ganesh_fig2.build(ReportContext())
    md = (isolated_dirs / "results" / "ganesh_fig2.md").read_text()
    claims = fig2_claims(md)
    assert len(claims) == 5 and "incomplete" not in md and "Missing runs" not in md
    assert "- IME beats post-processing (dpmf noise): **agrees, not decided** (0.6030 vs 0.6060" in md
    assert "- IME for free beats post-processing (independent noise, our extra column" in md


def test_missing_runs_are_matched_on_the_swept_values_only():
    spec = sweep_spec("ganesh_fig2", "cpu")
    point = spec.points()[0]
    assert point == {"optimizer": "adagrad_pp", "noise": "none", "optimizer.lr": 0.0316}

    class Run:
        def __init__(self, cfg):
            self.config = cfg

    cfg = {
        "optimizer": {"name": "adagrad_pp", "lr": 3.16e-2, "eps": 1e-8},
        "noise": {"kind": "none"},
        "seed": 0,
    }
    missing = expected.missing_runs(spec, [Run(cfg)])
    assert len(missing) == 90 and point not in missing  # 0.0316 == 3.16e-2; unswept keys do not matter
    other = {**cfg, "optimizer": {"name": "adagrad_pp", "lr": 0.0317}}
    assert len(expected.missing_runs(spec, [Run(other)])) == 91


def test_reported_on_gives_the_test_metric_of_the_setting_chosen_on_val(isolated_dirs):
    """Selected on val_loss, reported on test_loss: the cell holds the chosen setting's test values (not the
    setting that would win on test), its candidates the val means."""
    from dp_adam_bench.report.aggregate import reported_on

    root = isolated_dirs / "runs"
    for lr, val, test in ((0.1, 0.50, 0.70), (1.0, 0.40, 0.90)):
        for seed in (0, 1):
            folder = root / "g" / f"r{lr}-{seed}"
            folder.mkdir(parents=True)
            cfg = {"optimizer": {"name": "adam", "lr": lr}, "noise": {"kind": "independent"}, "seed": seed}
            (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
            metrics = {"val_loss": val + 0.01 * seed, "test_loss": test + 0.02 * seed}
            (folder / "summary.json").write_text(json.dumps({"status": "complete", "metrics": metrics}))
    records = load_local_runs(root, "g")
    cells = select_best(records, per=["optimizer"], tuned=["optimizer.lr"], metric="val_loss")
    out = reported_on(cells, records, lambda cfg: (cfg["optimizer"]["name"],), "test_loss")
    (cell,) = out.values()
    assert cell.chosen == {"optimizer.lr": 1.0} and cell.n == 2
    assert cell.mean == pytest.approx(0.91) and cell.std == pytest.approx(statistics.stdev([0.90, 0.92]))
    assert [m for _, m in cell.candidates] == pytest.approx([0.505, 0.405])
