"""The li_dialog table (dp_adam_bench/report/li_dialog.py) from run folders written here: cells beside the paper's
GPT-2 row, F1 and perplexity orderings (perplexity lower is better) with Welch's t-test."""

from __future__ import annotations

import pandas as pd
import pytest
from scipy import stats
from test_language_reports import write_run

from dp_adam_bench.report import li_dialog
from dp_adam_bench.report.context import ReportContext


def _store(root, cells: dict):
    for (init, noise, target), per_seed in cells.items():
        eps = (
            {"rdp": target, "gdp_clt": 0.8 * target, "prv": 0.9 * target, "pld": 0.9 * target}
            if target
            else {}
        )
        for seed, (f1, ppl) in enumerate(per_seed):
            write_run(
                root,
                "li_dialog_cpu",
                f"{init}-{noise}-{target}-{seed}",
                {
                    "task": {
                        "name": "dialog",
                        "profile": "cpu",
                        "pretrain": "gpt2_arxiv",
                        "pretrained": init == "pretrained",
                        "max_history": 3,
                    },
                    "optimizer": {"name": "adam", "lr": 2e-3},
                    "noise": {"kind": noise},
                    "privacy": {"sigma": None, "clip": 0.1, "delta": 1.87e-5, "target_epsilon": target},
                    "train": {"batch_size": 128, "clipping": "bk"},
                    "seed": seed,
                },
                {
                    "metrics": {"test_f1": f1, "test_perplexity": ppl, "test_loss": 3.0},
                    "epsilon": eps,
                    "steps": 40,
                    "data_note": "STAND-IN DATA: Synthetic-Persona-Chat",
                },
            )


def _state(better, worse) -> str:
    """The state scipy's Welch test puts ``better`` ahead of ``worse`` in (dp_adam_bench/report/stats.py)."""
    ref = stats.ttest_ind(better, worse, equal_var=False)
    if ref.pvalue < 0.05:
        return "holds" if ref.statistic > 0 else "contradicted"
    return "agrees, not decided" if ref.statistic > 0 else "disagrees, not decided"


def test_cells_paper_row_and_orderings(isolated_dirs):
    cells = {
        ("pretrained", "independent", 3.0): [(10.0, 40.0), (11.0, 42.0)],
        ("pretrained", "independent", 8.0): [(12.0, 35.0), (13.0, 36.0)],
        ("pretrained", "none", None): [(15.0, 20.0), (16.0, 21.0)],
        ("scratch", "independent", 3.0): [
            (5.0, 30.0),
            (6.0, 31.0),
        ],  # lower perplexity than pretrained: a miss
        ("scratch", "independent", 8.0): [(6.0, 80.0), (7.0, 81.0)],
        ("scratch", "none", None): [(9.0, 60.0), (9.5, 61.0)],
    }
    _store(isolated_dirs / "runs", cells)
    li_dialog.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "li_dialog.csv")
    f = df[df.quantity == "f1"].set_index(["init", "column"])
    assert f.loc[("pretrained", "eps3"), "paper"] == pytest.approx(15.90)
    assert f.loc[("pretrained", "eps3"), "ours"] == pytest.approx(10.5)
    assert pd.isna(f.loc[("scratch", "eps3"), "paper"])
    p = df[df.quantity == "perplexity"].set_index(["init", "column"])
    assert p.loc[("pretrained", "nonprivate"), "paper"] == pytest.approx(18.52)
    gdp = df[df.quantity.str.contains("CLT")].set_index(["init", "column"])
    assert gdp.loc[("pretrained", "eps8"), "paper"] == pytest.approx(6.00)
    md = (isolated_dirs / "results" / "li_dialog.md").read_text()
    assert (
        "## The paper's other rows (not run here)" in md
        and "| DialoGPT-medium | eps8 | 17.56 | 16.79 |" in md
    )
    # each ordering in the state scipy's Welch test (the oracle) puts it in, t > 0 the paper's direction
    assert f"f1: non-private > eps = 8: **{_state([15, 16], [12, 13])}**" in md
    assert "paper: 17.96 vs 16.08 (GPT-2)" in md
    assert f"perplexity: eps = 8 < eps = 3: **{_state([40, 42], [35, 36])}**" in md
    assert "paper: 23.57 vs 24.59 (GPT-2)" in md
    assert f"perplexity, eps3: pretrained < from scratch: **{_state([30, 31], [40, 42])}**" in md
    assert f"perplexity, eps8: pretrained < from scratch: **{_state([80, 81], [35, 36])}**" in md
    assert _state([30, 31], [40, 42]) == "contradicted" and _state([80, 81], [35, 36]) == "holds"
    assert _state([15, 16], [12, 13]) == "agrees, not decided"  # p = 0.051: not decided
    assert "STAND-IN DATA" in md


def test_the_gap_to_non_private_is_read_against_the_papers_relative_gap():
    from dp_adam_bench.report.skeleton import SeedStats

    pm = {
        "eps3": {"gpt2": {"f1": 15.0, "perplexity": 24.0}},
        "eps8": {"gpt2": {"f1": 16.0, "perplexity": 22.0}},
        "nonprivate": {"gpt2": {"f1": 20.0, "perplexity": 20.0}},
    }
    # paper's relative gaps: F1 25 % / 20 %, perplexity 20 % / 10 %
    f1 = {
        ("pretrained", "nonprivate"): SeedStats(10.0, 0.1, 2),
        ("pretrained", "eps3"): SeedStats(8.0, 0.2, 2),  # 20 % <= 25 %: holds
        ("pretrained", "eps8"): SeedStats(7.0, None, 1),  # 30 % > 20 %: does not
    }
    eps3, eps8 = li_dialog.gap_claims("f1", f1, pm)
    # eps3 against 0.75 x non-private (its mean and spread scaled): Welch's t, scipy's from the cells' stats
    ref = stats.ttest_ind_from_stats(8.0, 0.2, 2, 7.5, 0.075, 2, equal_var=False)
    assert eps3.state == ("holds" if ref.pvalue < 0.05 else "agrees, not decided")
    se2 = (0.2**2 / 2, 0.075**2 / 2)
    df = sum(se2) ** 2 / (se2[0] ** 2 + se2[1] ** 2)  # Welch-Satterthwaite, n - 1 = 1 on each side
    assert (
        f"t = {ref.statistic:+.2f} (Welch, df {df:.1f}), p = {ref.pvalue:.2g} over 2 / 2 seeds" in eps3.detail
    )
    assert eps8.state == "untested"  # one seed: 30 % against 20 %, but no spread to test it
    assert "ours +20.0 % (8 vs 10), paper +25.0 %" in eps3.detail and "ours +30.0 %" in eps8.detail
    ppl = {
        ("pretrained", "nonprivate"): SeedStats(10.0, 0.1, 2),
        ("pretrained", "eps8"): SeedStats(10.5, 0.1, 2),
    }
    (only,) = li_dialog.gap_claims("perplexity", ppl, pm)  # no eps3 cell: no claim
    ref = stats.ttest_ind_from_stats(
        11.0, 0.11, 2, 10.5, 0.1, 2, equal_var=False
    )  # 1.1 x non-private vs eps8
    assert ref.pvalue < 0.05 and only.state == "holds"
    assert "ours +5.0 %" in only.detail and "paper +10.0 %" in only.detail
    assert "private - 1.100 x non-private = -0.5: " in only.detail
    zero = {
        ("pretrained", "nonprivate"): SeedStats(0.0, 0.0, 2),
        ("pretrained", "eps8"): SeedStats(0.0, 0.0, 2),
    }
    assert li_dialog.gap_claims("f1", zero, pm) == []  # an F1 of 0 without noise: no relative gap to read
