"""The language-task reports on synthetic run folders: cell assignment, the selection rule, claims, and that
incomplete runs are left out and listed.

The synthetic stores are not the presets' full sweeps: ``all_expected`` says no run is missing, so that the claims
are checked (tests/test_report.py checks what a report does with missing runs)."""

import json

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats

from dp_adam_bench.report import (
    expected,
    ganesh_fig3,
    ganesh_figs4_6,
    li_e2e,
    tang_fig2,
    tang_fig3,
    tang_table1,
)
from dp_adam_bench.report.context import ReportContext


@pytest.fixture(autouse=True)
def all_expected(monkeypatch):
    monkeypatch.setattr(expected, "missing_runs", lambda spec, complete: [])


def write_run(root, experiment, name, cfg, summary=None, metrics=(), npz=None):
    folder = root / experiment / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps({"status": "complete", **summary}))
    if npz is not None:
        (folder / "diagnostics").mkdir()
        np.savez(folder / "diagnostics" / npz[0], **npz[1])
    return folder


# ---------------------------------------------------------------------------------------------- ganesh_fig3

LOW, HIGH = 0.0076783, 0.015625  # the cpu profile's sigmas (configs/experiment/ganesh_fig3.yaml)


def g3_cfg(opt, noise, sigma, lr, seed, **opt_kw):
    return {
        "task": {"name": "arxiv_mlm"},
        "optimizer": {"name": opt, "lr": lr, **opt_kw},
        "noise": {"kind": noise},
        "privacy": {"sigma": sigma, "clip": 1.0, "delta": 1e-7},
        "train": {"batch_size": 32},
        "seed": seed,
    }


@pytest.fixture
def g3_store(isolated_dirs):
    root, exp = isolated_dirs / "runs", "ganesh_fig3_cpu"
    losses = {  # (row optimizer, private) -> loss per column; stp best, ime worse than post-processing
        ("adam", True): (7.3, 7.5, 7.6),
        ("ime", True): (7.4, 7.6, 7.7),
        ("bc", True): (7.35, 7.55, 7.65),
        ("stp", True): (7.2, 7.4, 7.5),
        ("sgd", True): (7.5, 7.7, 7.8),
        ("noiseless_precond", True): (7.1, 7.3, 7.4),
        ("stp_noiseless_precond", True): (7.0, 7.2, 7.3),
    }
    cols = [("independent", LOW), ("bandmf", HIGH), ("independent", HIGH)]
    for (opt, _), vals in losses.items():
        for (noise, sigma), loss in zip(cols, vals, strict=True):
            for seed in (0, 1):
                write_run(
                    root,
                    exp,
                    f"{opt}-{noise}-{sigma}-s{seed}",
                    g3_cfg(opt, noise, sigma, 1e-3, seed),
                    {
                        "metrics": {"test_loss": loss + 0.01 * seed},
                        "epsilon": {"pld": 1e3},
                        "delta": 1e-7,
                        "steps": 96,
                    },
                    metrics=[{"step": 0, "test_loss": 10.3}],
                )
    # a worse learning rate for adam in the first column: the selection rule must not pick it
    write_run(
        root,
        exp,
        "adam-bad-lr",
        g3_cfg("adam", "independent", LOW, 1e-2, 0),
        {"metrics": {"test_loss": 9.0}, "steps": 96},
    )
    for opt, loss in (("sgd", 7.45), ("adam", 7.0)):
        write_run(
            root,
            exp,
            f"np-{opt}",
            g3_cfg(opt, "none", 0.0, 1e-3, 0),
            {"metrics": {"test_loss": loss}},
            metrics=[
                {"step": 0, "test_loss": 10.3},
                {"step": 8, "diag/frac_v_below_bias": 0.8, "diag/reference_bias": 3e-8},
            ],
            npz=("step_8.npz", {"v_private": np.geomspace(1e-12, 1e-6, 100)}),
        )
    write_run(root, exp, "stp-crashed", g3_cfg("stp", "bandmf", HIGH, 1e-3, 5))  # no summary: incomplete
    return isolated_dirs


@pytest.mark.slow
def test_ganesh_fig3_cells_selection_and_claims(g3_store):
    ganesh_fig3.build(ReportContext())
    df = pd.read_csv(g3_store / "results" / "ganesh_fig3.csv")
    post = df[(df.row == "postprocessing") & (df.column == "dpsgd_sigma0.134")].iloc[0]
    assert post.ours == pytest.approx(7.305) and post.n == 2 and "lr=0.001" in post.chosen  # not the bad lr
    assert post.paper == pytest.approx(3.251)
    init = df[df.row == "no_finetuning"].iloc[0]
    assert init.ours == pytest.approx(10.3) and init.column == "dpsgd_sigma0.134"
    assert df[(df.row == "nonprivate_adam")].iloc[0].ours == pytest.approx(7.0)
    md = (g3_store / "results" / "ganesh_fig3.md").read_text()
    assert "[ours] DP-BandMF: scale-then-privatize has the lowest loss of the DP variants: **holds**" in md
    assert "[ours] DP-SGD, sigma at BandMF's RMSE: IME is worse than post-processing: **holds**" in md
    assert "[ours] DP-BandMF beats DP-SGD at the same epsilon for every DP variant: **holds**" in md
    assert "[paper] DP-SGD, sigma at BandMF's epsilon: IME is worse than post-processing: **matches**" in md
    assert "exact: the paper's printed means compared as printed" in md
    assert "Incomplete runs left out: stp-crashed" in md
    # each ordering with Welch's t over the seeds (scipy's, the oracle), and the seed-noise section with one line
    # per compared pair: post-processing 7.3 / 7.31 vs IME 7.4 / 7.41 in the first column
    ime = stats.ttest_ind([7.4, 7.41], [7.3, 7.31], equal_var=False)
    assert (
        "[ours] DP-SGD, sigma at BandMF's RMSE: IME is worse than post-processing: **holds** (post-processing vs "
        f"ime: 7.305 vs 7.405, margin +0.100; t = {ime.statistic:+.2f} (Welch, df {ime.df:.1f}), "
        f"p = {ime.pvalue:.2g} over 2 / 2 seeds)"
    ) in md
    assert "## Seed noise: the comparisons of the claims" in md
    assert (
        "| postprocessing @ dpsgd_sigma0.134 | ime @ dpsgd_sigma0.134 | +0.1000 | 0.0071 | "
        f"{ime.statistic:.4f} | {ime.df:.4f} | {ime.pvalue:.4f} | yes |  |"
    ) in md
    assert "| stp @ bandmf_sigma1_b128 | postprocessing @ bandmf_sigma1_b128 |" in md
    # one seed a cell (the non-private rows here): no test, and the claim says so
    assert (
        "non-private Adam beats non-private SGD: **untested** (7.000 vs 7.450, margin +0.450; no test: 1 / 1 "
        in md
    )
    assert "| nonprivate_adam @ dpsgd_sigma0.134 | nonprivate_sgd @ dpsgd_sigma0.134 | +0.4500 |" in md


def _seed_rows(cells: dict) -> dict:
    """The seed section ganesh_fig3 writes for a table of these cells ({(row, column): (mean, sample std, n)}),
    as {(first, second): its row}."""
    from dp_adam_bench.report.restate_md import read_markdown_table

    frame = pd.DataFrame(
        [
            {"row": r, "column": c, "paper": None, "ours": m, "ours_sample_std": sd, "n": n, "chosen": ""}
            for (r, c), (m, sd, n) in cells.items()
        ]
    )
    table = read_markdown_table(ganesh_fig3.seed_section(frame).split("\n\n", 1)[1])
    return {
        (f, s): row
        for f, s, row in zip(table["first"], table["second"], table.to_dict("records"), strict=True)
    }


def test_ganesh_fig3_seed_section_against_simulation_and_scipy():
    """The seed section's SE of a difference of seed means against a simulation of seeds drawn with a known
    spread; its test against scipy's Welch t; the seeds a cell that would decide it against a search with scipy."""
    col = ganesh_fig3.COLUMNS[0]
    a, b = ("postprocessing", col), ("ime", col)
    rng = np.random.default_rng(0)
    n, sd, d = 4, 0.05, 0.03
    sims = []
    for _ in range(20_000):
        xa, xb = rng.normal(0.0, sd, n), rng.normal(d, sd, n)
        sims.append(xb.mean() - xa.mean())
    row = _seed_rows({a: (5.0, sd, n), b: (5.0 + d, sd, n)})[(f"{a[0]} @ {col}", f"{b[0]} @ {col}")]
    assert row["se"] == pytest.approx(np.std(sims), rel=0.03)
    welch = stats.ttest_ind_from_stats(5.0 + d, sd, n, 5.0, sd, n, equal_var=False)
    # equal spreads and seeds: the Welch-Satterthwaite df is 2 (n - 1)
    assert (row["t"], row["df"], row["p"]) == pytest.approx(
        (welch.statistic, 2 * (n - 1), welch.pvalue), abs=5e-5
    )
    need = next(
        m for m in range(n + 1, 1000) if stats.ttest_ind_from_stats(d, sd, m, 0, sd, m, False).pvalue < 0.05
    )
    assert row["decided (p < 0.05)"] == "no" and row["seeds to decide"] == need > n  # never the count run
    one = _seed_rows({a: (5.0, None, 1), b: (5.0 + d, sd, n)})[(f"{a[0]} @ {col}", f"{b[0]} @ {col}")]
    assert one["decided (p < 0.05)"] == "no test: fewer than 2 seeds a cell" and pd.isna(
        one["seeds to decide"]
    )
    # a diverged run's loss: no test and no count (math.ceil(nan) used to raise, taking the whole report down)
    inf = _seed_rows({a: (5.0, sd, n), b: (float("inf"), sd, n)})[(f"{a[0]} @ {col}", f"{b[0]} @ {col}")]
    assert inf["decided (p < 0.05)"] == "no test: a value not finite" and pd.isna(inf["seeds to decide"])
    assert _seed_rows({a: (5.0, float("nan"), n), b: (5.0 + d, sd, n)})[
        (f"{a[0]} @ {col}", f"{b[0]} @ {col}")
    ]["decided (p < 0.05)"].startswith("no test")


def test_pilots_report_chooses_per_group_and_checks_the_grid_edges(isolated_dirs):
    from dp_adam_bench.report import pilots

    root, exp = isolated_dirs / "runs", "ganesh_fig3_pilots_cpu"
    losses = {  # (optimizer, noise, sigma) -> {lr: val loss}; adam's best inside, sgd's at the edge, one NaN
        ("adam", "none", 0.0): {1e-4: 5.44, 3e-4: 5.41, 1e-3: float("nan")},
        ("sgd", "none", 0.0): {0.001: 5.60, 0.003: 5.62},
    }
    for (opt, noise, sigma), by_lr in losses.items():
        for lr, loss in by_lr.items():
            write_run(
                root, exp, f"{opt}-{lr}", g3_cfg(opt, noise, sigma, lr, 0), {"metrics": {"test_loss": loss}}
            )
    pilots.build(ReportContext(), "ganesh_fig3_pilots", "ganesh_fig3", "on the val split")
    df = pd.read_csv(isolated_dirs / "results" / "ganesh_fig3_pilots.csv")
    chosen = df[df.chosen == "yes"]
    assert sorted(zip(chosen.optimizer, chosen.lr, strict=True)) == [("adam", 3e-4), ("sgd", 0.001)]
    assert np.isnan(
        df[(df.optimizer == "adam") & (df.lr == 1e-3)].test_loss.iloc[0]
    )  # diverged: listed, not chosen
    md = (isolated_dirs / "results" / "ganesh_fig3_pilots.md").read_text()
    assert "optimizer=adam, noise=none: the chosen optimizer.lr is inside its grid: **matches**" in md
    assert "optimizer=sgd, noise=none: the chosen optimizer.lr is inside its grid: **differs**" in md
    assert "exact: which grid value the tuning chose is a fact of its runs, no test over seeds" in md
    assert "make reproduce-table TABLE=ganesh_fig3_pilots PROFILE=cpu" in md
    assert "`ganesh_fig3` uses the chosen values" in md
    # pilots shared by two tables name both
    pilots.build(ReportContext(), "ganesh_fig3_pilots", ("ganesh_fig3", "ganesh_figs4_6"), "on the val split")
    md = (isolated_dirs / "results" / "ganesh_fig3_pilots.md").read_text()
    assert "`ganesh_fig3` and `ganesh_figs4_6` use the chosen values" in md


def test_tuning_report_checks_each_knob_through_the_chosen_setting(isolated_dirs):
    """Several tuned knobs (ganesh_fig3_tuning): the chosen setting is the best mean over the whole grid; each
    knob's edge check runs along the slice through it (the other knobs at their chosen values), and knobs a
    group does not set (adam has no eps_s1) are neither printed nor checked."""
    from dp_adam_bench.report import pilots

    root, exp = isolated_dirs / "runs", "ganesh_fig3_tuning_cpu"
    # (lr, eps_s1) -> val loss, best at (3e-4, 1e-6): lr inside its slice (1e-4, 3e-4, 1e-3); eps_s1 at the edge
    # of its slice at lr = 3e-4 (1e-7, 1e-6), though inside the whole grid (1e-5 was tried at lr = 1e-4 only)
    stp = {(3e-4, 1e-7): 5.60, (3e-4, 1e-6): 5.50, (1e-4, 1e-6): 5.58, (1e-3, 1e-6): 5.70, (1e-4, 1e-5): 5.90}
    for (lr, e1), loss in stp.items():
        cfg = g3_cfg("stp", "independent", HIGH, lr, 0, eps_s1=e1)
        write_run(root, exp, f"stp-{lr}-{e1}", cfg, {"metrics": {"test_loss": loss}})
    for lr, loss in ((1e-4, 5.52), (3e-4, 5.51)):
        cfg = g3_cfg("adam", "independent", HIGH, lr, 0)
        write_run(root, exp, f"adam-{lr}", cfg, {"metrics": {"test_loss": loss}})
    pilots.build(ReportContext(), "ganesh_fig3_tuning", "ganesh_fig3", "on the val split")
    df = pd.read_csv(isolated_dirs / "results" / "ganesh_fig3_tuning.csv")
    chosen = df[df.chosen == "yes"]
    assert sorted(zip(chosen.optimizer, chosen.lr, chosen.eps_s1.fillna(0), strict=True)) == [
        ("adam", 3e-4, 0),
        ("stp", 3e-4, 1e-6),
    ]
    md = (isolated_dirs / "results" / "ganesh_fig3_tuning.md").read_text()
    assert md.startswith("# Tuning runs of ganesh_fig3")
    label = "optimizer=stp, noise=independent, sigma=0.015625: the chosen optimizer"
    assert f"{label}.lr is inside its grid: **matches**" in md
    assert (
        f"{label}.eps_s1 is inside its grid: **differs** (optimizer.eps_s1 = 1e-06 of 1e-07, 1e-06; exact: "
        in md
    )
    assert "optimizer=adam, noise=independent, sigma=0.015625: the chosen optimizer.eps_s1" not in md
    assert "Not checked against an edge" not in md  # every knob has a slice of two or more through the choice
    # a coordinate-wise grid whose best point has no neighbour along a knob: said, not claimed either way
    cfg = g3_cfg("stp", "independent", HIGH, 6e-4, 0, eps_s1=1e-3)
    write_run(root, exp, "stp-best-alone", cfg, {"metrics": {"test_loss": 5.40}})
    pilots.build(ReportContext(), "ganesh_fig3_tuning", "ganesh_fig3", "on the val split")
    md = (isolated_dirs / "results" / "ganesh_fig3_tuning.md").read_text()
    assert (
        "optimizer=stp, noise=independent, sigma=0.015625: optimizer.lr = 0.0006 (tried 0.0001, 0.0003, 0.0006, "
        "0.001 at other settings of the other knobs)" in md
    )
    assert "optimizer.eps_s1 = 0.001 (tried 1e-07, 1e-06, 1e-05, 0.001" in md
    assert f"{label}.lr is inside its grid" not in md


@pytest.mark.slow
def test_ganesh_fig3_explains_stp_from_its_diagnostics(g3_store):
    """The STP note reads its runs' diagnostics per column; the 'scale is ~1 / eps_s1' reading is printed only
    when sqrt(v^) exceeds eps_s1 in under 5 % of coordinates in every column that logged them."""
    root, exp = g3_store / "runs", "ganesh_fig3_cpu"
    keys = {"diag/frac_clipped": 1.0, "diag/norm_over_clip_median": 250.0}

    def stp_run(name, sigma, above):
        cfg = g3_cfg("stp", "independent", sigma, 3e-4, 5, eps_s1=1e-4)
        metrics = [{"step": 8, **keys, "diag/stp_frac_sqrtv_above_eps_s1": above}]
        write_run(root, exp, name, cfg, {"metrics": {"test_loss": 9.0}}, metrics=metrics)

    stp_run("stp-low", LOW, 0.01)
    ganesh_fig3.build(ReportContext())
    md = (g3_store / "results" / "ganesh_fig3.md").read_text()
    assert "dpsgd_sigma0.134 (eps_s1 = 0.0001, C = 1, sigma C / B = 0.00024): 100.0% of the scaled" in md
    assert "median norm 250 C, sqrt(v^) > eps_s1 in 1.00% of coordinates" in md
    assert "preconditioner stays nearly flat" in md
    stp_run("stp-high", HIGH, 0.40)  # one column where the scale is far from uniform: no such reading
    ganesh_fig3.build(ReportContext())
    md = (g3_store / "results" / "ganesh_fig3.md").read_text()
    assert "sqrt(v^) > eps_s1 in 40.00% of coordinates" in md and "stays nearly flat" not in md


@pytest.mark.slow
def test_ganesh_fig3_sets_its_rows_beside_the_horizon_studys_wider_grid_at_its_horizon(g3_store):
    """The horizon study's runs at ganesh_fig3's own horizon (512 abstracts) choose eta on val from a wider grid:
    the Fig. 3 report names, per shared cell, the eta it ran and the one chosen there, with both test losses;
    runs at other horizons are not compared."""
    root = g3_store / "runs"
    for subset in (512, 1024):
        for lr, val, test in ((1e-3, 7.4, 7.5), (4e-3, 7.1, 7.2)):  # the table ran 1e-3 (g3_store)
            for seed in (0, 1):
                cfg = g3_cfg("adam", "independent", HIGH, lr, seed)
                cfg["task"]["train_subset"] = subset
                scores = {"val_loss": val + 0.01 * seed, "test_loss": test + 0.01 * seed}
                write_run(root, "ganesh_fig3_horizon_cpu", f"h{subset}-{lr}-{seed}", cfg, {"metrics": scores})
    ganesh_fig3.build(ReportContext())
    md = (g3_store / "results" / "ganesh_fig3.md").read_text()
    assert (
        "runs this table's 32-step setting again with eta chosen on val abstracts from a wider grid, for the "
        "cells its gaps need: postprocessing @ dpsgd_sigma1: ran eta 0.001 (test 7.605); the grid {0.001, 0.004} "
        "chooses 0.004 (test 7.205, -0.400)"
    ) in md
    assert md.count("the grid {0.001, 0.004}") == 1  # the 64-step runs are another horizon


def test_ganesh_figs4_6_from_the_same_runs(g3_store):
    root, exp = g3_store / "runs", "ganesh_fig3_cpu"
    diag = [
        {"step": s, "diag/frac_negative_after_bc": 0.47, "diag/grad_norm_over_clip": 0.3} for s in (8, 16)
    ]
    write_run(
        root,
        exp,
        "bc-diag",
        g3_cfg("bc", "independent", LOW, 1e-3, 7),
        {"metrics": {"test_loss": 7.3}},
        metrics=diag,
    )
    write_run(
        root,
        exp,
        "adam-diag",
        g3_cfg("adam", "independent", LOW, 1e-3, 7),
        {"metrics": {"test_loss": 7.3}},
        metrics=diag,
    )
    stp_diag = [
        {"step": s, "diag/frac_clipped": 1.0, "diag/stp_frac_sqrtv_above_eps_s1": f}
        for s, f in ((8, 0.1), (16, 0.3))
    ]
    write_run(
        root,
        exp,
        "stp-diag",
        g3_cfg("stp", "bandmf", HIGH, 1e-3, 7, eps_s1=1e-6),
        {"metrics": {"test_loss": 7.3}},
        metrics=stp_diag,
    )
    ganesh_figs4_6.build(ReportContext())
    md = (g3_store / "results" / "ganesh_figs4_6.md").read_text()
    # the STP rows per column: only BandMF's column has the logged run (mean over rounds 0.2); the setting printed
    assert "| STP: fraction of coordinates with sqrt(v^) > eps_s1 |  | 0.2 |  |" in md
    assert "bandmf_sigma1_b128: eps_s1 = 1e-06, C = 1, sigma C / B = 0.000488" in md
    assert "| BC: fraction of v^ - Phi < 0 | 0.47 |  |  |" in md
    # one bias-correction run and one non-private run logged them: one seed, so every claim is untested
    assert (
        "about half of the bias-corrected coordinates are negative: the median over rounds of the fraction is in "
        "45%-50% (+-5 points): **untested**"
    ) in md
    assert (
        "most coordinates of the non-private second moment fall below the bias C^2 sigma^2 / B^2: **untested**"
        in md
    )
    assert "no test: 1 seeds against" in md and "**holds**" not in md
    assert (g3_store / "results" / "ganesh_figs4_6.png").exists()


# ---------------------------------------------------------------------------------------------- tang SNLI


def snli_cfg(opt, seed, **kw):
    return {
        "task": {"name": "snli_bert"},
        "optimizer": {
            "name": opt,
            "lr": 1e-3,
            "beta1": 0.9,
            "beta2": 0.999,
            "eps": 1e-8,
            "gamma": 1e-9,
            "phi": None,
            "phi_scale": 1.0,
            **kw,
        },
        "noise": {"kind": "independent"},
        "privacy": {"sigma": 0.1, "clip": 0.1, "delta": 1e-5},
        "train": {"batch_size": 64},
        "diagnostics": {"every": 60},
        "seed": seed,
    }


def diag_row(step, phi=2.44140625e-8):
    row = {"step": step, "diag/phi": phi}
    for q, scale in (("v_clean", 1e-12), ("v_private", phi), ("v_private_minus_phi", 1e-10)):
        row |= {
            f"diag/{q}_{s}": scale * f
            for s, f in zip(
                ("min", "q1", "median", "q3", "max", "mean"), (0.5, 0.9, 1.0, 1.1, 2.0, 1.0), strict=True
            )
        }
    return row


def test_tang_table1_and_fig2(isolated_dirs):
    root = isolated_dirs / "runs"
    rng = np.random.default_rng(0)
    m = rng.normal(0, 1e-6, 1000)
    v_c = m**2 + 1e-13
    v_p = 2.44e-8 + rng.normal(0, 1e-9, 1000)
    arrays = {
        "m_clean": m,
        "m_private": m + rng.normal(0, 1e-4, 1000),
        "v_clean": v_c,
        "v_private": v_p,
        "v_private_minus_phi": v_p - 2.44e-8,
        "update_clean": m / np.sqrt(v_c),
        "update_private_v": m / np.sqrt(v_p),
        "update_corrected_v": m / np.sqrt(np.clip(v_p - 2.44e-8, 1e-30, None)),
    }
    for seed in (0, 1):
        write_run(
            root,
            "tang_fig1_snli_cpu",
            f"adam-s{seed}",
            snli_cfg("adam", seed),
            {"metrics": {"test_accuracy": 40.0}},
            metrics=[diag_row(60), diag_row(120)],
            npz=("step_120.npz", arrays),
        )
    tang_table1.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "tang_table1.csv")
    ours = df[(df.source.str.startswith("ours")) & (df.t == 120) & (df.quantity == "v^p")].iloc[0]
    assert ours["median"] == pytest.approx(2.44140625e-8)
    md = (isolated_dirs / "results" / "tang_table1.md").read_text()
    assert "Phi = (sigma C / B)^2 equals the paper's 2.441e-8: **matches**" in md
    # the paper's ratio cited at the step it belongs to (2.426e-8 / 2.441e-8 at t = 5000, 2.460e-8 at t = 20000)
    assert "median v^p / Phi in [0.9, 1.2] (paper: 0.994 at t = 5000, 1.008 at t = 20000)" in md
    # two seeds with the same ratio 1.0 (no spread): inside the band by 0.1, decided exactly (Welch, n - 1 df)
    assert (
        "median v^p / Phi = 1.000 at t = 120 (mean over seeds); t = +inf (Welch, df 1.0), p = 0.0e+00" in md
    )
    assert ": **holds** (median v^p / Phi = 1.000" in md and "**differs**" not in md
    tang_fig2.build(ReportContext())
    md = (isolated_dirs / "results" / "tang_fig2.md").read_text()
    assert (
        "the noise bias shrinks the update" in md and (isolated_dirs / "results" / "tang_fig2.png").exists()
    )


def tang_fig3_store(root):
    """One seed a point of every ablation of tang_fig3_snli (cpu), as its committed table has."""
    exp = "tang_fig3_snli_cpu"
    acc = {None: 50.0, 1e-7: 45.0, 1e-9: 48.0}
    for phi, a in acc.items():
        write_run(root, exp, f"phi-{phi}", snli_cfg("adambc", 0, phi=phi), {"metrics": {"test_accuracy": a}})
    for g, a in ((1e-7, 45.0), (1e-11, 49.0)):
        write_run(root, exp, f"g-{g}", snli_cfg("adambc", 0, gamma=g), {"metrics": {"test_accuracy": a}})
    for g, a in ((1e-6, 43.0), (1e-8, 42.5), (1e-10, 42.0)):  # default betas: gamma points only
        write_run(root, exp, f"gb-{g}", snli_cfg("adam", 0, eps=g), {"metrics": {"test_accuracy": a}})
    for b2, b1, a in ((0.9, 0.6838, 40.0), (0.99, 0.9, 44.0), (0.999, 0.9684, 42.0)):
        write_run(
            root, exp, f"b-{b2}", snli_cfg("adam", 0, beta1=b1, beta2=b2), {"metrics": {"test_accuracy": a}}
        )


def test_tang_fig3_sorts_runs_into_ablations(isolated_dirs):
    tang_fig3_store(isolated_dirs / "runs")
    tang_fig3.build(ReportContext(), "snli")
    df = pd.read_csv(isolated_dirs / "results" / "tang_fig3_snli.csv")
    assert set(df.ablation) == {"phi", "gamma_bc", "gamma_biased", "beta"}
    assert len(df[df.ablation == "gamma_biased"]) == 3
    assert len(df[df.ablation == "phi"]) == 3 and len(df[df.ablation == "gamma_bc"]) == 3
    md = (isolated_dirs / "results" / "tang_fig3_snli.md").read_text()
    assert (
        "subtracting more than the true Phi hurts: accuracy(true Phi) > accuracy(Phi' > Phi): **untested**"
        in md
    )
    assert "DP-Adam-Biased: beta2 = 0.99 is the best of the beta sweep: **untested**" in md
    assert (
        "spread over the gamma' grid > spread over the gamma grid: **untested** (5.00 (45.00-50.00) vs 1.00"
        in md
    )
    # one seed a point: no Welch test, so every ordering is untested, in the Gap's own words
    no_test = "no test: 1 / 1 seeds)"
    assert (
        "DP-AdamBC (true Phi) > DP-Adam-Biased at the best of its gamma: **untested** (50.00 vs 43.00, margin +7.00; "
        + no_test
    ) in md
    assert (
        "DP-AdamBC (true Phi) > DP-Adam-Biased at the best of its betas: **untested** (50.00 vs 44.00, margin +6.00; "
        + no_test
    ) in md
    assert (
        "(beta2 0.9: 40.00, beta2 0.99: 44.00, beta2 0.999: 42.00; 44.00 vs 42.00, margin +2.00; " + no_test
    ) in md
    assert ("vs 1.00 (42.00-43.00), the paper's direction; " + no_test) in md
    assert md.count("**untested**") == 6 and "**not checked**" not in md and "**holds**" not in md
    # one seed has no spread: the sample std is empty, not 0
    assert df["test_accuracy_sample_std"].isna().all() and "std" not in df.columns


def test_tang_fig3_names_its_profile_and_seeds_per_point(isolated_dirs):
    """The note said "one seed per point on the cpu profile" at the paper profile too."""
    root, exp = isolated_dirs / "runs", "tang_fig3_snli_paper"
    for seed in (0, 1):  # the true-Phi default point has two seeds, the others one
        write_run(
            root, exp, f"phi-true-{seed}", snli_cfg("adambc", seed), {"metrics": {"test_accuracy": 50.0}}
        )
    write_run(root, exp, "phi-7", snli_cfg("adambc", 0, phi=1e-7), {"metrics": {"test_accuracy": 45.0}})
    write_run(root, exp, "gb-6", snli_cfg("adam", 0, eps=1e-6), {"metrics": {"test_accuracy": 43.0}})
    tang_fig3.build(ReportContext(profile="paper", out=isolated_dirs / "results" / "paper"), "snli")
    md = (isolated_dirs / "results" / "paper" / "tang_fig3_snli.md").read_text()
    assert "- 1-2 seeds per point on the paper profile: one seed gives a point no spread" in md
    assert (
        "accuracy(true Phi) > accuracy(Phi' > Phi): **untested** (50.00 vs 45.00, margin +5.00; no test: 2 / 1 seeds)"
    ) in md
    assert "see results/paper/tang_fig1_snli.md." in md and "cpu profile" not in md
    assert (
        tang_fig3._seeds_per_point([1, 1]) == "One seed" and tang_fig3._seeds_per_point([3, 3]) == "3 seeds"
    )


def test_tang_fig3_judges_its_orderings_by_welchs_t(isolated_dirs):
    """Three seeds a point: each ordering with Welch's test (scipy's is the oracle), flagged only where the seeds do
    not decide it; the gap between two grids' spreads is no two-cell comparison, so it is never decided."""
    root, exp = isolated_dirs / "runs", "tang_fig3_snli_cpu"
    points = {
        ("adambc", "phi-true"): ({}, (50.0, 51.0, 52.0)),  # also gamma_bc's point at the paper's gamma'
        ("adambc", "phi-over"): ({"phi": 1e-7}, (44.0, 45.0, 46.0)),
        ("adambc", "phi-under"): ({"phi": 1e-9}, (50.0, 51.5, 53.0)),
        ("adambc", "g-7"): ({"gamma": 1e-7}, (45.0, 46.0, 47.0)),
        ("adam", "gb-6"): ({"eps": 1e-6}, (43.0, 44.0, 45.0)),
        ("adam", "gb-8"): ({"eps": 1e-8}, (42.0, 43.0, 44.0)),
    }
    for (opt, name), (kw, accs) in points.items():
        for seed, acc in enumerate(accs):
            write_run(
                root, exp, f"{name}-{seed}", snli_cfg(opt, seed, **kw), {"metrics": {"test_accuracy": acc}}
            )
    tang_fig3.build(ReportContext(), "snli")
    df = pd.read_csv(isolated_dirs / "results" / "tang_fig3_snli.csv")
    # rows by ablation, then x: gamma_bc 1e-9 (the true-Phi runs), 1e-7; gamma_biased 1e-8, 1e-6; phi 1e-9, Phi, 1e-7
    assert df["test_accuracy_sample_std"].tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.5, 1.0, 1.0])
    md = (isolated_dirs / "results" / "tang_fig3_snli.md").read_text()
    lines = {ln.split(": **")[0]: ln for ln in md.splitlines() if ln.startswith("- ") and ": **" in ln}
    over = stats.ttest_ind([50.0, 51.0, 52.0], [44.0, 45.0, 46.0], equal_var=False)
    assert over.pvalue < 0.05
    more = lines["- subtracting more than the true Phi hurts: accuracy(true Phi) > accuracy(Phi' > Phi)"]
    assert more.endswith(
        f"**holds** (51.00 vs 45.00, margin +6.00; t = {over.statistic:+.2f} (Welch, df {over.df:.1f}), "
        f"p = {over.pvalue:.2g} over 3 / 3 seeds)"
    )
    under = stats.ttest_ind([50.0, 51.0, 52.0], [50.0, 51.5, 53.0], equal_var=False)
    under_line = next(v for k, v in lines.items() if "subtracting less" in k)
    assert (
        f"**disagrees, not decided** (51.00 vs 51.50, margin -0.50; t = {under.statistic:+.2f} (Welch, df "
        f"{under.df:.1f}), p = {under.pvalue:.2g} over 3 / 3 seeds; not decided: p = {under.pvalue:.2g} >= 0.05"
    ) in under_line
    spread = next(v for k, v in lines.items() if "spread over the gamma' grid" in k)
    assert spread.endswith(
        "**untested** (5.00 (46.00-51.00) vs 1.00 (43.00-44.00), the paper's direction; no test: 3 / 3 seeds, and "
        "Welch's t compares two cells, not the spreads of two grids)"
    )
    best_gamma = stats.ttest_ind([50.0, 51.0, 52.0], [43.0, 44.0, 45.0], equal_var=False)
    assert (
        f"at the best of its gamma: **holds** (51.00 vs 44.00, margin +7.00; t = {best_gamma.statistic:+.2f} "
        f"(Welch, df {best_gamma.df:.1f}), p = {best_gamma.pvalue:.2g} over 3 / 3 seeds)\n"
    ) in md
    assert "- 3 seeds per point on the cpu profile" in md and "No ordering above" not in md


# ---------------------------------------------------------------------------------------------- li_e2e


def _li_cfg(noise, target, pretrained):
    return {
        "task": {
            "name": "e2e_gpt2",
            "profile": "cpu",
            "pretrain": "gpt2_arxiv",
            "pretrained": pretrained,
            "test_subset": 100,
            "num_beams": 5,
        },
        "optimizer": {"name": "adam", "lr": 2e-3},
        "noise": {"kind": noise},
        "privacy": {"sigma": None, "clip": 0.1, "delta": 1.1887e-5, "target_epsilon": target},
        "train": {"batch_size": 512, "clipping": "bk"},
        "seed": 0,
    }


def _li_store(root, bleus: dict):
    """One run per (pretrained, noise, target) and seed with the given BLEU (one number: seed 0 only; a tuple: one a
    seed), ROUGE-L = BLEU + 5."""
    for (pretrained, noise, target), per_seed in bleus.items():
        eps = (
            {"rdp": target, "gdp_clt": 0.9 * target, "prv": 0.95 * target, "pld": 0.95 * target}
            if target
            else {}
        )
        for seed, bleu in enumerate(np.atleast_1d(per_seed).tolist()):
            write_run(
                root,
                "li_e2e_cpu",
                f"{pretrained}-{noise}-{target}" + (f"-{seed}" if seed else ""),
                _li_cfg(noise, target, pretrained) | {"seed": seed},
                {
                    "metrics": {"test_bleu": bleu, "test_rougeL": bleu + 5, "test_loss": 10.0 - bleu / 10},
                    "epsilon": eps,
                    "sigma": 0.5 if target else 0.0,
                    "steps": 30,
                    "data_note": "GPT-2 architecture (...) PRETRAINED NON-PRIVATELY by `dp-adam-bench pretrain "
                    "gpt2_arxiv`"
                    if pretrained
                    else "GPT-2 architecture (...) of the gpt2_arxiv preset TRAINED FROM SCRATCH",
                },
            )


def test_li_e2e_pretrained_and_scratch_rows_and_claims(isolated_dirs):
    _li_store(
        isolated_dirs / "runs",
        {
            (True, "independent", 3.0): 40.0,
            (True, "independent", 8.0): 45.0,
            (True, "none", None): 50.0,
            (False, "independent", 3.0): 1.0,
            (False, "independent", 8.0): 47.0,  # scratch beats pretrained at eps = 8: a claim that fails
            (False, "none", None): 20.0,
        },
    )
    li_e2e.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "li_e2e.csv")
    bleu = df[df.quantity == "bleu"].set_index(["init", "column"])
    assert bleu.loc[("pretrained", "eps3"), "paper"] == pytest.approx(61.519)
    assert bleu.loc[("pretrained", "nonprivate"), "ours"] == 50.0
    assert bleu.loc[("scratch", "eps8"), "ours"] == 47.0 and np.isnan(bleu.loc[("scratch", "eps8"), "paper"])
    assert bleu["ours_sample_std"].isna().all()  # one seed a cell: no spread to show (not 0)
    assert "ours_std" not in df.columns
    gdp = df[df.quantity.str.contains("CLT")].set_index(["init", "column"])
    assert gdp.loc[("pretrained", "eps8"), "paper"] == pytest.approx(6.77)
    assert gdp.loc[("pretrained", "eps8"), "ours"] == pytest.approx(7.2)
    md = (isolated_dirs / "results" / "li_e2e.md").read_text()
    assert "bleu, pretrained: non-private > eps = 8 > eps = 3: **untested**" in md
    assert "bleu, eps3: under DP the pretrained model beats the same network trained from scratch" in md
    # one seed a cell: no Welch test, every seed claim untested in the Gap's own words, whichever way it goes
    no_test = "no test: 1 / 1 seeds"
    assert (
        "(Li et al.: pretraining is what makes DP fine-tuning work): **untested** (40.00 vs 1.00, margin +39.00; "
        f"{no_test})" in md
    )
    scratch_wins = "(Li et al.: pretraining is what makes DP fine-tuning work): **untested** (45.00 vs 47.00"
    assert f"{scratch_wins}, margin -2.00; {no_test})" in md
    no_test_link = "no test: 1 / 1 seeds"
    assert (
        "test_loss, pretrained: non-private < eps = 8 < eps = 3: **untested** (5.00 / 5.50 / 6.00; eps 8 - eps 3 = "
        f"-0.50: {no_test_link}; non-private - eps 8 = -0.50: {no_test_link})" in md
    )
    assert "**holds**" not in md
    assert (
        "test_loss, eps3: under DP the pretrained model beats" in md
        and f"(6.00 vs 9.90, margin +3.90; {no_test})" in md
    )
    loss = df[df.quantity == "test_loss"].set_index(["init", "column"])
    assert loss.loc[("scratch", "eps3"), "ours"] == pytest.approx(9.9) and np.isnan(loss["paper"]).all()
    # 45 / 50 = 0.90 >= 0.8
    assert (
        "x the non-private BLEU (our goal for the CPU profile; paper 0.91): **untested** (45.00 / 50.00 = 0.90; "
        f"eps 8 - 0.8 x non-private = +5.00: {no_test_link})" in md
    )
    # the accountants' claims compare one run's epsilons, not seeds: exact, with the reason
    assert (
        "PRV than under RDP (as in the paper): **matches** (RDP 3.000, GDP-CLT 2.700, PRV 2.850; exact: each "
        "epsilon is a deterministic function of the run's sigma, q, steps and delta" in md
    )
    assert "No comparison above can be tested (each says why: one seed a cell" in md
    assert "PRETRAINED NON-PRIVATELY" in md
    assert "Adam lr 0.002 constant" in md


def test_li_e2e_seed_spread_seed_noise_and_schedule_words(isolated_dirs):
    """Two seeds a cell: the sample standard deviation (ddof = 1), the ordering's margins each with Welch's t-test
    (scipy's is the oracle) and, where it does not decide, the flag, and a linear schedule named in the setting."""
    runs = isolated_dirs / "runs"
    cells = {
        ("independent", 3.0): (39.0, 41.0),
        ("independent", 8.0): (40.0, 44.0),
        ("none", None): (60.0, 62.0),
    }
    for (noise, target), bleus in cells.items():
        for seed, bleu in enumerate(bleus):
            cfg = _li_cfg(noise, target, True) | {"seed": seed}
            cfg["train"] |= {"lr_schedule": "linear", "lr_warmup_steps": 5}
            write_run(
                runs, "li_e2e_cpu", f"{noise}-{target}-{seed}", cfg,
                {"metrics": {"test_bleu": bleu, "test_rougeL": bleu, "test_loss": 1.0},
                 "epsilon": {"rdp": target} if target else {}, "sigma": 0.5 if target else 0.0, "steps": 30},
            )  # fmt: skip
    li_e2e.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "li_e2e.csv")
    row = df[(df.quantity == "bleu") & (df.column == "eps8")].iloc[0]
    assert row.ours == 42.0 and row.n == 2
    assert row.ours_sample_std == pytest.approx(np.std([40.0, 44.0], ddof=1))
    md = (isolated_dirs / "results" / "li_e2e.md").read_text()
    assert "Adam lr 0.002 decayed linearly to ~0 after 5 warm-up steps" in md
    # eps 8 - eps 3 = 2 at sample variances 8 and 2: p = 0.49, not decided; non-private - eps 8 = 19: p = 0.03
    low = stats.ttest_ind([40.0, 44.0], [39.0, 41.0], equal_var=False)
    high = stats.ttest_ind([60.0, 62.0], [40.0, 44.0], equal_var=False)
    assert low.pvalue >= 0.05 and high.pvalue < 0.05
    need = next(
        n
        for n in range(3, 10_000)
        if stats.ttest_ind_from_stats(42, np.sqrt(8), n, 40, np.sqrt(2), n, equal_var=False).pvalue < 0.05
    )
    # one link decided, the other not: the chain agrees with the paper, not decided
    assert "bleu, pretrained: non-private > eps = 8 > eps = 3: **agrees, not decided** (" in md
    assert (
        f"eps 8 - eps 3 = +2.00: t = {low.statistic:+.2f} (Welch, df {low.df:.1f}), p = {low.pvalue:.2g} over "
        f"2 / 2 seeds, not decided: p = {low.pvalue:.2g} >= 0.05 by Welch's t; ~{need} seeds a cell would "
        "decide it if the gap and spread seen were the truth; "
        f"non-private - eps 8 = +19.00: t = {high.statistic:+.2f} (Welch, df {high.df:.1f}), "
        f"p = {high.pvalue:.2g} over 2 / 2 seeds)" in md
    )


def test_li_e2e_goal_ratio_fails_below_0_8(isolated_dirs):
    _li_store(
        isolated_dirs / "runs",
        {(True, "independent", 3.0): 10.0, (True, "independent", 8.0): 39.0, (True, "none", None): 50.0},
    )
    li_e2e.build(ReportContext())
    md = (isolated_dirs / "results" / "li_e2e.md").read_text()
    assert (
        "**untested** (39.00 / 50.00 = 0.78; eps 8 - 0.8 x non-private = -1.00: no test: 1 / 1 seeds)" in md
    )
    assert "scratch" not in pd.read_csv(isolated_dirs / "results" / "li_e2e.csv")["init"].tolist()


def test_li_ghost_clipping_reads_the_engine_benchmark(isolated_dirs, tmp_path, monkeypatch):
    rows = [
        ("gpt2_small", 8, "nonprivate", 10.0, 4.0),
        ("gpt2_small", 8, "hooks", 30.0, 12.0),
        ("gpt2_small", 8, "ghost", 25.0, 5.0),
        ("gpt2_small", 8, "bk", 15.0, 4.5),
        ("gpt2_small", 8, "functorch", 1.0, 1.0),  # not one of the figure's modes
    ]
    df = pd.DataFrame(rows, columns=["model", "batch_size", "mode", "median_step_s", "peak_rss_gib"])
    df["ratio_to_nonprivate"] = df.median_step_s / 10.0
    df["ratio_mem_to_nonprivate"] = df.peak_rss_gib / 4.0
    df["physical_batch_size"] = 8
    csv = tmp_path / "results_engines.csv"
    df.to_csv(csv, index=False)
    from dp_adam_bench.report import li_ghost_clipping

    monkeypatch.setattr(li_ghost_clipping, "CSV", csv)
    li_ghost_clipping.build()
    out = pd.read_csv(isolated_dirs / "results" / "li_ghost_clipping.csv")
    assert list(out["mode"]) == ["nonprivate", "hooks", "ghost", "bk"]
    assert out.set_index("mode").loc["bk", "examples_per_s"] == pytest.approx(8 / 15.0)
    md = (isolated_dirs / "results" / "li_ghost_clipping.md").read_text()
    # one process per configuration: no repeat to test against, so untested, with the direction it goes
    assert (
        "gpt2_small: ghost clipping needs less memory than per-example gradients at every batch size: **untested** "
        "(B=8: 5.00 vs 12.00 GiB; the claimed direction at every batch size; no test: one process per "
        "configuration" in md
    )
    assert (
        "gpt2_small: book-keeping (one backward) is at least as fast as Opacus ghost clipping (two): **untested** "
        "(B=8: 0.5 vs 0.3 ex/s; the claimed direction at every batch size;" in md
    )


def test_tang_fig1_snli_checks_the_snli_orderings(isolated_dirs):
    from dp_adam_bench.report import tang_fig1

    root = isolated_dirs / "runs"
    # gaps of 6 points and more at a spread of 0.71 a cell: Welch's p <= 0.014, every ordering decided
    for opt, acc in (("sgd", 34.0), ("adam", 54.0), ("adambc", 60.0)):
        for seed in (0, 1):
            cfg = snli_cfg(opt, seed) | {"train": {"batch_size": 64, "clipping": "bk"}}
            write_run(
                root,
                "tang_fig1_snli_cpu",
                f"{opt}-{seed}",
                cfg,
                {"metrics": {"test_accuracy": acc + seed}, "steps": 100, "epsilon": {"rdp": 7.0}},
                metrics=[{"step": 100, "test_accuracy": acc + seed}],
            )
    tang_fig1.build(ReportContext(), "snli")
    md = (isolated_dirs / "results" / "tang_fig1_snli.md").read_text()
    assert "DP-AdamBC > DP-Adam-Biased: **holds**" in md
    assert (
        "DP-Adam-Biased > DP-SGD: **holds**" in md and "DP-SGD >= DP-AdamBC" not in md
    )  # that is CIFAR-10's
    assert "not decided:" not in md and "indistinguishable" not in md and md.count("**holds**") == 3


def test_tang_fig1_says_when_every_ordering_is_within_seed_noise(isolated_dirs):
    from dp_adam_bench.report import tang_fig1

    for opt, acc in (("sgd", 69.0), ("adam", 69.3), ("adambc", 68.7)):
        for seed in (0, 1):  # +-0.5 around acc: a standard error of 0.71 for each difference
            write_run(
                isolated_dirs / "runs",
                "tang_fig1_snli_cpu",
                f"{opt}-{seed}",
                snli_cfg(opt, seed) | {"train": {"batch_size": 64, "clipping": "bk"}},
                {"metrics": {"test_accuracy": acc + seed - 0.5}, "steps": 100, "epsilon": {"rdp": 7.0}},
                metrics=[{"step": 100, "test_accuracy": acc + seed - 0.5}],
            )
    tang_fig1.build(ReportContext(), "snli")
    md = (isolated_dirs / "results" / "tang_fig1_snli.md").read_text()
    # 69.3 - 69.0 = 0.3 points at a spread of 0.71 per seed: Welch's t = 0.42 on 2 degrees of freedom (scipy's
    # test is the oracle); 0.3 / sqrt(2 * 0.5 / n) passes t(0.975, 2n - 2) first at n = 44 seeds a cell
    welch = stats.ttest_ind([68.8, 69.8], [68.5, 69.5], equal_var=False)
    assert (
        f"DP-Adam-Biased > DP-SGD: **agrees, not decided** (69.30 vs 69.00 %, margin +0.30; t = "
        f"{welch.statistic:+.2f} " in md
    )
    assert f"(Welch, df {welch.df:.1f}), p = {welch.pvalue:.2g} over 2 / 2 seeds" in md
    assert f"not decided: p = {welch.pvalue:.2g} >= 0.05 by Welch's t; ~44 seeds a cell would decide it" in md
    assert "DP-AdamBC > DP-Adam-Biased: **disagrees, not decided**" in md
    assert "at this budget the optimizers are indistinguishable" in md


# ------------------------------------------------------------------------------------------ ganesh_fig3_horizon


def _run_config(point: dict) -> dict:
    """A run config (nested) from a sweep point's overrides; the CPU profile's own subset where it sets none."""
    cfg = {
        "task": {"name": "arxiv_mlm", "train_subset": 512},
        "train": {"batch_size": 32},
        "seed": point["seed"],
    }
    for k, v in point.items():
        key = expected.GROUP_FIELDS.get(k, k)
        *path, leaf = key.split(".")
        node = cfg
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = v
    return cfg


def _horizon_runs(root, base_subset: int, base_offset: float) -> list[float]:
    """Every run of the horizon preset (cpu) and ganesh_fig3's runs of the same cells at ``base_subset`` abstracts
    (their loss ``base_offset`` above the formula), losses built so that STP - post-processing turns negative at
    96 steps and BandMF - DP-SGD and post-processing - DP-SGD never do; the horizon runs score val and test so
    that each cell's largest learning rate wins on val and would lose on test. Returns each cell's grid,
    {(optimizer, noise): sorted learning rates}."""
    from dp_adam_bench.sweep import sweep_spec

    horizon = sweep_spec("ganesh_fig3_horizon", "cpu")
    followed = {(p["optimizer"], p["noise"]) for p in horizon.points()}
    base = [
        p | {"task.train_subset": base_subset}
        for p in sweep_spec("ganesh_fig3", "cpu").points()
        if (p["optimizer"], p["noise"]) in followed and float(p["privacy.sigma"]) == HIGH
    ]
    gap = {256: 0.15, 512: 0.10, 1024: 0.03, 1536: -0.10}  # STP - post-processing at 16, 32, 64, 96 steps
    grids = {
        cell: sorted({p["optimizer.lr"] for p in horizon.points() if (p["optimizer"], p["noise"]) == cell})
        for cell in followed
    }
    assert all(len(g) >= 2 for g in grids.values())  # every horizon is tuned
    for spec_name, points in (("ganesh_fig3_cpu", base), ("ganesh_fig3_horizon_cpu", horizon.points())):
        for i, p in enumerate(points):
            cfg = _run_config(p)
            subset, seed = cfg["task"]["train_subset"], p["seed"]
            loss = 6.0 - 0.1 * np.log2(subset / 512) + 0.01 * seed
            loss += gap[subset] if p["optimizer"] == "stp" else 0.0
            loss += 0.2 if p["noise"] == "bandmf" else 0.0
            scores = {"test_loss": loss + base_offset}
            if spec_name == "ganesh_fig3_horizon_cpu":
                top = p["optimizer.lr"] == grids[(p["optimizer"], p["noise"])][-1]
                scores = {"test_loss": loss if top else loss - 0.5, "val_loss": loss - (0.05 if top else 0.0)}
            phi = 2.4e-7 * (2.25 if p["noise"] == "bandmf" else 1.0)  # BandMF: more noise a step at one sigma
            metrics = [
                {
                    "step": 8,
                    "diag/frac_clipped": 1.0,
                    "diag/stp_frac_sqrtv_above_eps_s1": 0.25,
                    "diag/phi": phi,
                    "diag/v_clean_median": 2.4e-15,
                }
            ]
            write_run(root, spec_name, f"r{i}", cfg, {"metrics": scores}, metrics=metrics)
    return grids


@pytest.mark.slow
def test_ganesh_horizon_follows_the_gaps_across_horizons(isolated_dirs):
    """The cpu profile runs every horizon itself (32 steps included, on its own eta grid): ganesh_fig3's 32-step
    runs are not read; each cell's eta is chosen on val_loss and its test_loss reported; the gaps carry standard
    errors over seeds, the claims name the first horizon from which the paper's sign holds, and the trend line's
    zero crossing is an extrapolation."""
    from dp_adam_bench.report import ganesh_horizon

    grids = _horizon_runs(isolated_dirs / "runs", 512, base_offset=1.0)
    lrs = grids[("adam", "independent")]
    ganesh_horizon.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "ganesh_fig3_horizon.csv")
    assert sorted(set(df.steps)) == [32, 64, 96] and set(df.n) == {2}
    assert len(df) == 12  # 4 cells x 3 horizons
    cell_of = {
        ("dpsgd_momentum", "dpsgd_sigma1"): ("sgd", "independent"),
        ("postprocessing", "dpsgd_sigma1"): ("adam", "independent"),
        ("postprocessing", "bandmf_sigma1_b128"): ("adam", "bandmf"),
        ("stp", "dpsgd_sigma1"): ("stp", "independent"),
    }
    for row, col, chosen in zip(df.row, df.column, df.chosen, strict=True):  # chosen on val_loss ...
        assert f"lr={grids[cell_of[(row, col)]][-1]:g}" in chosen
    pp = df[(df.row == "postprocessing") & (df.column == "dpsgd_sigma1")].set_index("steps").test_loss
    assert pp[64] == pytest.approx(6.0 - 0.1 + 0.005)  # ... and reported on test_loss
    assert pp[32] == pytest.approx(6.005)  # this preset's 32-step runs, not ganesh_fig3's (1.0 higher)
    md = (isolated_dirs / "results" / "ganesh_fig3_horizon.md").read_text()
    assert "every horizon run by this preset" in md and "its own runs are not read" in md
    assert "## The tuning at each horizon" in md and md.count(f"lr={lrs[0]:g}") >= 9
    grid = ", ".join(f"{v:g}" for v in lrs)
    assert f"postprocessing @ dpsgd_sigma1, 64 steps: lr = {lrs[-1]:g} of {{{grid}}}, the top" in md  # a note
    assert (
        "[grid] postprocessing @ dpsgd_sigma1, 64 steps: lr: the chosen value is inside its grid: **differs**"
        in md
    ) == (len(lrs) > 2)
    # the step-size reading: Phi ratio 2.25 -> BandMF's steps 1 / 1.5 as large; Phi 1e8 x the clean v
    assert "96 steps: Phi 5.4e-07 (BandMF) vs 2.4e-07 (independent), ratio 2.25: BandMF's steps 0.67x" in md
    assert "median clean v 2.4e-15 (1e+08x below Phi)" in md
    claim = "negative (the paper's sign) beyond seed noise at every horizon from some horizon run on"
    assert (
        f"STP - post-processing, DP-SGD noise at BandMF's sigma: {claim}: **holds** (from 96 steps on; " in md
    )
    assert (
        f"BandMF - DP-SGD (same epsilon), post-processing: {claim}: **contradicted** (at none of the horizons "
        "run; " in md
    )
    assert (
        f"post-processing - DP-SGD with momentum, DP-SGD noise at BandMF's sigma: {claim}: **disagrees, not "
        "decided** (at none of the horizons run; " in md
    )
    assert (
        "32 steps: +0.1000 ± 0.0071, t = " in md
    )  # the seeds differ by 0.01 in both cells: SE = 0.01 / sqrt(2)
    # STP - post-processing at 32 steps, 6.1 / 6.11 vs 6.0 / 6.01: decided by Welch's t (scipy's, the oracle), so
    # no seeds to decide; at 64 steps +0.03 is not, and the seeds a cell that would decide it are more than 2
    at32 = stats.ttest_ind([6.1, 6.11], [6.0, 6.01], equal_var=False)
    assert (
        at32.pvalue < 0.05
        and (
            f"| 32 | 0.1000 | 2 | contradicted | 0.0071 | {at32.statistic:.4f} | {at32.df:.4f} | "
            f"{at32.pvalue:.4f} | yes |  |"
        )
        in md
    )
    at64 = stats.ttest_ind([6.03, 6.04], [6.0, 6.01], equal_var=False)
    sd = np.std([6.0, 6.01], ddof=1)
    need = next(
        m for m in range(3, 1000) if stats.ttest_ind_from_stats(0.03, sd, m, 0, sd, m, False).pvalue < 0.05
    )
    assert (
        at64.pvalue >= 0.05
        and need > 2
        and (
            f"| 64 | 0.0300 | 2 | disagrees, not decided | 0.0071 | {at64.statistic:.4f} | {at64.df:.4f} | "
            f"{at64.pvalue:.4f} | no | {need} |"
        )
        in md
    )
    assert (
        md.count("a straight line would cross zero near") == 0
    )  # STP's line ends negative; BandMF's is flat
    assert (isolated_dirs / "results" / "ganesh_fig3_horizon.png").is_file()
    assert "| stp | dpsgd_sigma1 | 96 | 1 |" in md.replace("1.0000", "1")  # the diagnostics section


@pytest.mark.slow
def test_ganesh_horizon_scores_the_chosen_setting_on_held_out_seeds(isolated_dirs):
    """Runs of sweep.selection.heldout_seeds take no part in any choice: the table and the tuning section keep
    2 seeds a cell, the held-out section scores each cell at the setting seeds 0 and 1 chose, its gaps become
    claims, and a held-out run at another setting is named as stale."""
    from dp_adam_bench.report import ganesh_horizon
    from dp_adam_bench.sweep import sweep_spec

    root = isolated_dirs / "runs"
    grids = _horizon_runs(root, 512, base_offset=1.0)  # its held-out runs ran the preset's ho_* values
    spec = sweep_spec("ganesh_fig3_horizon", "cpu")
    held = spec.selection.heldout_seeds
    assert held and not set(held) & set(spec.seeds)
    points = [p for p in spec.points() if p["seed"] in held]
    top = {cell: grid[-1] for cell, grid in grids.items()}
    # the same cells again at the chosen (top) setting, STP 0.05 below the rest
    for i, p in enumerate(points):
        p = p | {"optimizer.lr": top[(p["optimizer"], p["noise"])]}
        loss = 5.0 + 0.001 * p["seed"] - (0.05 if p["optimizer"] == "stp" else 0.0)
        write_run(root, "ganesh_fig3_horizon_cpu", f"h{i}", _run_config(p), {"metrics": {"test_loss": loss}})
    ganesh_horizon.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "ganesh_fig3_horizon.csv")
    assert set(df.n) == {2}  # the held-out seeds are in no cell of the table
    md = (isolated_dirs / "results" / "ganesh_fig3_horizon.md").read_text()
    assert f"## Held-out seeds ({', '.join(map(str, held))})" in md
    mean, n = 4.95 + 0.001 * sum(held) / len(held), len(held)
    stp = top[("stp", "independent")]
    stp_held = [4.95 + 0.001 * seed for seed in held]
    spread = np.std(stp_held, ddof=1)  # the sample std over the held-out seeds
    assert (
        f"| 96 | stp | dpsgd_sigma1 | {mean:.4f} | {spread:.3e} | {n} | lr={stp:g}, eps_s1=0.0001, clip=100 |"
        in md
    )
    welch = stats.ttest_ind(stp_held, [5.0 + 0.001 * seed for seed in held], equal_var=False)
    assert welch.pvalue < 1e-3  # printed as 2.0e-04
    assert (
        "[held-out seeds] STP - post-processing, DP-SGD noise at BandMF's sigma, 96 steps: negative (the paper's "
        f"sign) beyond seed noise: **holds** (-0.0500 ± 0.0007, t = {welch.statistic:+.2f} (Welch, df "
        f"{welch.df:.1f}), p = {welch.pvalue:.1e} over {n} / {n} seeds (seeds {', '.join(map(str, held))})"
    ) in md
    assert "[held-out seeds] BandMF - DP-SGD (same epsilon), post-processing, 96 steps" in md
    # the runs at the preset's ho_* values (not the top of these synthetic grids) are stale
    stale = [p for p in points if p["optimizer.lr"] != top[(p["optimizer"], p["noise"])]]
    assert stale and "Held-out runs at a setting their cell no longer chooses" in md
    first = top[(stale[0]["optimizer"], stale[0]["noise"])]
    assert f"ran lr={stale[0]['optimizer.lr']:g}" in md and f"chosen lr={first:g}" in md


@pytest.mark.slow
def test_ganesh_horizon_reads_the_base_tables_runs_at_a_horizon_it_does_not_run(isolated_dirs, monkeypatch):
    """As the paper profile reads ganesh_fig3's ~2,000-step runs: a base horizon the preset does not run (here
    16 steps, by a patched setting) is merged in, selected by the base table's own rule on test_loss."""
    from dp_adam_bench.report import ganesh_horizon

    setting = dict(ganesh_fig3.profile_setting("cpu"), train_subset=256)
    monkeypatch.setattr(ganesh_horizon, "profile_setting", lambda profile: setting)
    _horizon_runs(isolated_dirs / "runs", 256, base_offset=0.0)
    ganesh_horizon.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "ganesh_fig3_horizon.csv")
    assert sorted(set(df.steps)) == [16, 32, 64, 96] and len(df) == 16
    md = (isolated_dirs / "results" / "ganesh_fig3_horizon.md").read_text()
    assert "the 16-step horizon is ganesh_fig3's own runs" in md
    assert "16 steps: +0.1500 ± 0.0071" in md


def test_ganesh_horizon_trend_extrapolates_only_toward_the_papers_sign():
    from dp_adam_bench.report.ganesh_horizon import trend

    slope, crossing = trend([32, 64, 128], [0.3, 0.2, 0.1])
    assert slope == pytest.approx(-0.1) and crossing == pytest.approx(256)
    assert trend([32, 64, 128], [0.1, 0.2, 0.3])[1] is None  # moving away from the paper: no crossing
    assert trend([32, 64], [0.1, 0.1])[1] is None  # flat: none either
    assert trend([32], [0.1]) is None


def test_stp_clip_evidence_prints_its_reading_only_when_the_numbers_show_it():
    from types import SimpleNamespace

    s = ganesh_fig3.profile_setting("cpu")  # B = 32; sigma_high = 0.015625: sigma C / B < 1 iff C < 2048

    def run(clip, rounds):
        cfg = g3_cfg("stp", "independent", HIGH, 3e-4, 0, eps_s1=1e-4)
        cfg["privacy"]["clip"] = clip
        metrics = [
            {"step": 8 * (i + 1), "diag/frac_clipped": f, "diag/norm_over_clip_median": n,
             "diag/stp_frac_sqrtv_above_eps_s1": 0.0, "diag/stp_scale_min": m}
            for i, (f, n, m) in enumerate(rounds)
        ]  # fmt: skip
        return SimpleNamespace(config=cfg, summary={"metrics": {"test_loss": 5.6}}, metrics=lambda: metrics)

    quiet = run(100.0, [(1.0, 3800.0, 2e3), (1.0, 3200.0, 3e3)])
    loud = run(1e4, [(0.0, 0.5, 0.03), (0.0, 0.002, 2e-7)])
    (text,) = ganesh_fig3.stp_clip_evidence([loud, quiet], s)
    assert (
        "C = 100, eps_s1 = 0.0001 (sigma C / B = 0.0488; rounds 8 -> 16): fraction clipped 1.00 -> 1.00"
        in text
    )
    assert "smallest scale 0.03 -> 2e-07, val loss 5.600" in text
    assert "norms (3.2e+05 to 3.2e+05 at the last logged round" in text and "C < B / sigma = 2048" in text
    # the large clip's scale does not collapse: only the numbers, no reading
    flat = run(1e4, [(0.0, 0.5, 0.03), (0.0, 0.4, 0.02)])
    (text,) = ganesh_fig3.stp_clip_evidence([flat, quiet], s)
    assert "no clip does both" not in text and text.endswith("val loss 5.600.")


def test_tuning_agreement_flags_a_table_run_with_values_its_tuning_no_longer_chooses():
    """ganesh_fig3 runs the values under sweep.profiles.cpu; when ganesh_fig3_tuning's runs (after a grid was
    widened) choose another one, the table says it is stale and names the cell, the knob and both values."""
    from types import SimpleNamespace

    s = ganesh_fig3.profile_setting("cpu")

    def run(opt, lr, loss, **kw):
        cfg = g3_cfg(opt, "independent", HIGH, lr, 0, **kw)
        return SimpleNamespace(config=cfg, summary={"metrics": {"test_loss": loss}}, complete=True)

    runs = [run("adam", 3e-4, 5.6), run("adam", 6e-4, 5.5), run("bc", 3e-4, 5.5, eps_s=1e-4)]
    values = {
        "pp_lr": {"high": [3e-4], "low": [6e-4]},
        "bc_lr": {"high": [3e-4]},
        "bc_eps_s": {"high": [1e-4]},
    }
    (note,) = ganesh_fig3.tuning_agreement(runs, s, values)
    assert (
        note.startswith("STALE:")
        and "adam @ independent sigma 0.015625: lr = 0.0006 chosen, 0.0003 run (pp_lr.high)" in note
    )
    assert "bc @" not in note  # bc's choice is what the table ran
    fixed = values | {"pp_lr": {"high": [6e-4], "low": [3e-4]}}
    (note,) = ganesh_fig3.tuning_agreement(runs, s, fixed)
    assert (
        note
        == "The tuned values this table ran are ganesh_fig3_tuning's choices (3 checked against its runs)."
    )
    # each column is checked against its own values: a sigma_low cell against pp_lr.low, not the high column's
    low_run = SimpleNamespace(
        config=g3_cfg("adam", "independent", s["sigma_low"], 1.2e-3, 0),
        summary={"metrics": {"test_loss": 5.4}},
        complete=True,
    )
    (note,) = ganesh_fig3.tuning_agreement([*runs, low_run], s, fixed)
    assert "adam @ independent sigma 0.0076783: lr = 0.0012 chosen, 0.0003 run (pp_lr.low)" in note
    assert "sigma 0.015625" not in note
    assert ganesh_fig3.tuning_agreement([], s, values) == []


def test_ganesh_fig3_names_noiseless_baselines_that_end_above_the_initial_model():
    """A noiseless baseline runs its private row's learning rate; where that diverges (a loss above the initial
    model's) the report says so with the setting, and says nothing when every baseline trained."""
    from types import SimpleNamespace

    low, band, high = ganesh_fig3.COLUMNS
    cells = {
        ("stp_noiseless_precond", high): SimpleNamespace(
            chosen={"optimizer.lr": 6e-4, "privacy.clip": 100.0}
        ),
        ("noiseless_precond", low): SimpleNamespace(
            chosen={"optimizer.lr": 3e-4, "optimizer.momentum": None}
        ),
    }
    values = {
        ("no_finetuning", low): 6.545,
        ("stp_noiseless_precond", high): 182.5,
        ("noiseless_precond", low): 5.6,
    }
    (note,) = ganesh_fig3.baseline_note(values, cells)
    assert f"stp_noiseless_precond @ {high}: 182.500 (lr=0.0006, clip=100)" in note
    assert "noiseless_precond @" not in note.replace("stp_noiseless_precond @", "")
    assert ganesh_fig3.baseline_note(values | {("stp_noiseless_precond", high): 6.0}, cells) == []
    assert ganesh_fig3.baseline_note({("stp_noiseless_precond", high): 182.5}, cells) == []
