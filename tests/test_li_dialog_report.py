"""The li_dialog table (dp_adam_bench/report/li_dialog.py) from run folders written here: cells beside the paper's
GPT-2 row, F1 and perplexity orderings (perplexity lower is better) with Welch's t-test."""

from __future__ import annotations

import pandas as pd
import pytest
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
    assert "f1: non-private > eps = 8: **holds**" in md and "paper: 17.96 vs 16.08 (GPT-2)" in md
    assert "perplexity: eps = 8 < eps = 3: **holds**" in md and "paper: 23.57 vs 24.59 (GPT-2)" in md
    assert "perplexity, eps3: pretrained < from scratch: **does not hold**" in md
    assert "perplexity, eps8: pretrained < from scratch: **holds**" in md
    assert "STAND-IN DATA" in md
