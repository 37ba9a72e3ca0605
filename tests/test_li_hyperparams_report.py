"""The li_hyperparams table (dp_adam_bench/report/li_hyperparams.py) from run folders written here: the BLEU grid,
sigma_eff = sigma / q from each run's privacy ledger, the gradient-SNR from its logged clean-gradient norms (a
diagnostic), the three claims and the heatmap."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from test_language_reports import write_run

from dp_adam_bench.report import li_hyperparams
from dp_adam_bench.report.context import ReportContext

N, C, D = 16_384, 0.1, 2_900_000
SIGMA = {64: 0.9, 256: 1.4, 1024: 3.5}  # calibrated sigma grows with q, sigma / q falls


def _store(root, bleu: dict, spread: float = 0.5):
    """Two seeds a cell (the preset's), at the cell's BLEU -/+ ``spread``."""
    for (b, lr), mean in bleu.items():
        for seed, value in enumerate((mean - spread, mean + spread)):
            _store_run(root, b, lr, seed, value)


def _store_run(root, b, lr, seed, value):
    q = b / N
    write_run(
        root,
        "li_hyperparams_cpu",
        f"b{b}-lr{lr}-s{seed}",
        {
            "task": {"name": "e2e_gpt2", "train_subset": N},
            "optimizer": {"name": "adam", "lr": lr},
            "noise": {"kind": "independent"},
            "privacy": {"clip": C, "delta": 3.05e-5, "target_epsilon": 3.0},
            "train": {"batch_size": b, "steps": N // b},
            "seed": seed,
        },
        {
            "metrics": {"test_bleu": value, "test_rougeL": value + 3},
            "sigma": SIGMA[b],
            "steps": N // b,
            "ledger": {"events": [{"kind": "poisson_gaussian", "sigma": SIGMA[b], "q": q, "count": N // b}]},
            "finetune": {"method": None, "trainable_params": D},
            "data_note": "E2E subset",
        },
        metrics=[{"step": 4 * k, "diag/grad_norm_over_clip": 0.1 * k * math.sqrt(b)} for k in (1, 2, 3)],
    )


def test_grid_sigma_eff_snr_and_claims(isolated_dirs):
    bleu = {
        (64, 5e-4): 20.0,
        (64, 2e-3): 22.0,
        (64, 8e-3): 21.0,
        (256, 5e-4): 25.0,
        (256, 2e-3): 30.0,
        (256, 8e-3): 12.0,
        (1024, 5e-4): 28.0,
        (1024, 2e-3): 27.0,
        (1024, 8e-3): 26.0,
    }
    _store(isolated_dirs / "runs", bleu)
    li_hyperparams.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "li_hyperparams.csv").set_index(["batch_size", "lr"])
    assert df.loc[(256, 2e-3), "bleu"] == 30.0 and df.loc[(64, 5e-4), "steps"] == 256
    assert df.loc[(256, 2e-3), "n"] == 2 and df.loc[(256, 2e-3), "bleu_sample_std"] == pytest.approx(
        math.sqrt(0.5)
    )
    assert df.loc[(64, 5e-4), "sigma_eff"] == pytest.approx(0.9 * N / 64)
    # median over the logged steps of (||g|| / C) C / (sigma C sqrt(d) / B): the middle step, k = 2
    want = 0.2 * math.sqrt(256) * C / (1.4 * C * math.sqrt(D) / 256)
    assert df.loc[(256, 5e-4), "gradient_snr"] == pytest.approx(want)
    md = (isolated_dirs / "results" / "li_hyperparams.md").read_text()
    # 22 < 30 > 28, each cell's seeds at -/+ 0.5: both gaps p < 0.05 by Welch's t, but each best lr is picked on
    # the seeds the test reads: agreed and disagreed with, never decided, and said why
    assert (
        "the best BLEU over learning rates is higher at B = 256 (lr 0.002) than at B = 64 (lr 0.002): **agrees, "
        "not decided** (30.00 vs 22.00 BLEU, margin +8.00" in md
    )
    assert (
        "the best BLEU over learning rates is higher at B = 1024 (lr 0.0005) than at B = 256 (lr 0.002): "
        "**disagrees, not decided** (28.00 vs 30.00" in md
    )
    assert (
        md.count("not an independent test: each batch size's best learning rate is picked on the very seeds")
        == 2
    )
    assert "**holds**" not in md
    assert "larger batches do better at a fixed eps and number of epochs" in md and "Welch" in md
    # B = 1024's best is not higher: the note gives each batch size's step count at one epoch
    assert "(Adam steps per run: B = 64: 256, B = 256: 64, B = 1024: 16)" in md
    assert "sigma_eff = sigma N / B falls as the batch size grows: **matches**" in md
    assert "exact: sigma is calibrated by the RDP accountant" in md
    # the SNR cells keep no spread over seeds: untested, its direction said
    assert "the gradient-SNR grows with the batch size (diagnostic): **untested**" in md
    assert "the paper's direction; no test: the table keeps each cell's mean gradient-SNR" in md
    # sqrt rule anchored at B = 1024: 3.5 sqrt(64 / 1024) = 0.875 < 0.9, the sigma B = 64 was calibrated to
    assert df.loc[(64, 5e-4), "sigma_sqrt_rule"] == pytest.approx(0.875)
    assert "underestimates the noise multiplier at the smallest batch size: **matches**" in md
    # the exact curve: RDP calibration for the runs' N, one epoch, eps 3; sigma rises with B, and the rule's
    # shortfall is largest at the smallest B (B_min / 8 = 8 .. 1024)
    assert "| 8 | 2048 |" in md and "| 1024 | 16 |" in md
    ratios = [
        float(line.split("|")[5])
        for line in md.splitlines()
        if line.startswith("| 8 |") or line.startswith("| 1024 | 16 |")
    ]
    assert ratios[0] > 2 and ratios[1] == pytest.approx(1.0)
    # the best lr per B: 2e-3 at 64 and 256, 5e-4 at 1024; none at the grid's edge (8e-3)
    assert "Best learning rate per batch size: B = 64: 0.002, B = 256: 0.002, B = 1024: 0.0005" in md
    assert "lower bound" not in md
    assert "picked on the same seeds it is scored on" in md
    assert (isolated_dirs / "results" / "li_hyperparams.png").is_file()
    assert np.isfinite(df["gradient_snr"]).all()


def test_a_best_lr_at_the_grid_edge_is_called_a_lower_bound():
    frame = pd.DataFrame(
        {
            "batch_size": [64, 64, 1024, 1024],
            "lr": [5e-4, 8e-3, 5e-4, 8e-3],
            "bleu": [20.0, 18.0, 10.0, 15.0],
        }
    )
    (note,) = li_hyperparams.best_lr_note(frame)
    assert (
        "B = 64: 0.0005, B = 1024: 0.008" in note and "At B = 1024 the best is the largest lr tried" in note
    )


def test_the_steps_note_appears_only_where_a_larger_batch_is_not_better():
    from dp_adam_bench.report.common import Claim

    frame = pd.DataFrame({"batch_size": [64, 1024], "steps": [256, 16]})
    text = "the best BLEU over learning rates is higher at B = 1024 (lr 0.002) than at B = 64 (lr 0.002)"
    for state in ("holds", "agrees, not decided", "untested"):  # untested: no direction to read it against
        assert li_hyperparams.steps_note(frame, [Claim(text, state, "")]) == []
    for state in ("disagrees, not decided", "contradicted"):
        assert len(li_hyperparams.steps_note(frame, [Claim(text, state, "")])) == 1
    (note,) = li_hyperparams.steps_note(frame, [Claim(text, "disagrees, not decided", "")])
    assert "(Adam steps per run: B = 64: 256, B = 1024: 16)" in note
