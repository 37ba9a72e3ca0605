"""The li_e2e_methods table (dp_adam_bench/report/li_e2e_methods.py) from run folders written here: one cell per
(method, privacy column) beside the paper's digits, the claims (full ~ LoRA, the orderings, each method's privacy
levels) with Welch's t-test (scipy's is the oracle), the trainable counts."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml
from scipy import stats as sps
from test_language_reports import write_run

from dp_adam_bench.report import li_e2e_methods
from dp_adam_bench.report.context import ReportContext

REPO = Path(__file__).resolve().parents[1]
TRAINABLE = {
    "full": 2_900_000,
    "lora": 12_288,
    "prefix": 400_000,
    "rgp": 6_000,
    "top2": 400_000,
    "retrain": 2_900_000,
}


# each method's learning rate in the preset's cpu profile (the report checks the runs against the preset's plan)
CPU_LR = yaml.safe_load((REPO / "configs" / "experiment" / "li_e2e_methods.yaml").read_text())["profiles"][
    "cpu"
]["lr"]


def _lr_words(method: str) -> str:
    private, nonprivate = CPU_LR[method], CPU_LR[f"{method}_nonprivate"]
    return f"{method} {private:g}" + ("" if private == nonprivate else f" / {nonprivate:g}")


def _cfg(method, noise, target, seed):
    return {
        "task": {
            "name": "e2e_gpt2",
            "profile": "cpu",
            "pretrain": "gpt2_arxiv",
            "pretrained": False if method == "retrain" else None,
            "finetune": "full" if method == "retrain" else method,
            "test_subset": 50,
        },
        "optimizer": {"name": "adam", "lr": CPU_LR[method + ("_nonprivate" if noise == "none" else "")]},
        "noise": {"kind": noise},
        "privacy": {"sigma": None, "clip": 0.1, "delta": 1.1887e-5, "target_epsilon": target},
        "train": {"batch_size": 256, "clipping": "bk", "lr_schedule": "constant"},
        "seed": seed,
    }


def _store(root, bleu: dict):
    for (method, noise, target), per_seed in bleu.items():
        eps = (
            {"rdp": target, "gdp_clt": 0.8 * target, "prv": 0.9 * target, "pld": 0.9 * target}
            if target
            else {}
        )
        for seed, b in enumerate(per_seed):
            write_run(
                root,
                "li_e2e_methods_cpu",
                f"{method}-{noise}-{target}-{seed}",
                _cfg(method, noise, target, seed),
                {
                    "metrics": {
                        "test_bleu": b,
                        "test_rougeL": b + 5,
                        "test_loss": 5.0 if method == "prefix" else 2.0,
                    },
                    "epsilon": eps,
                    "steps": 40,
                    "train_time_s": 120.0,
                    "finetune": {"method": method, "trainable_params": TRAINABLE[method]},
                    "data_note": "E2E train (42061) / test (50 MRs); GPT-2 pretrained on arXiv",
                },
            )


def _state(ref) -> str:
    """The state of a comparison by scipy's Welch test, t > 0 the paper's direction."""
    if ref.pvalue < 0.05:
        return "holds" if ref.statistic > 0 else "contradicted"
    return "agrees, not decided" if ref.statistic > 0 else "disagrees, not decided"


def test_cells_paper_digits_claims_and_counts(isolated_dirs):
    bleu = {}
    for method, base in [
        ("full", 40),
        ("lora", 38),
        ("prefix", 30),
        ("rgp", 35),
        ("top2", 20),
        ("retrain", 10),
    ]:
        bleu[(method, "independent", 3.0)] = (base, base + 2)
        bleu[(method, "independent", 8.0)] = (base + 4, base + 6)
        bleu[(method, "none", None)] = (base + 10, base + 12)
    bleu[("lora", "independent", 8.0)] = (30.0, 31.0)  # far behind full at eps = 8
    _store(isolated_dirs / "runs", bleu)
    li_e2e_methods.build(ReportContext())
    df = pd.read_csv(isolated_dirs / "results" / "li_e2e_methods.csv")
    b = df[df.quantity == "bleu"].set_index(["method", "column"])
    assert b.loc[("lora", "eps3"), "paper"] == pytest.approx(58.153)
    assert b.loc[("retrain", "nonprivate"), "paper"] == pytest.approx(65.731)
    assert b.loc[("full", "eps3"), "ours"] == pytest.approx(41.0) and b.loc[("full", "eps3"), "n"] == 2
    assert b.loc[("lora", "eps3"), "trainable_params"] == 12_288
    r = df[df.quantity == "rouge_l"].set_index(["method", "column"])
    assert r.loc[("rgp", "eps8"), "paper"] == pytest.approx(65.030) and r.loc[("rgp", "eps8"), "ours"] == 45.0
    prv = df[df.quantity.str.startswith("epsilon, PRV")].set_index(["method", "column"])
    assert (
        prv.loc[("prefix", "eps3"), "paper"] == pytest.approx(2.75)
        and prv.loc[("prefix", "eps3"), "ours"] == 2.7
    )
    md = (isolated_dirs / "results" / "li_e2e_methods.md").read_text()
    # "within 5 BLEU": Welch's test of the nearer bound, the cell behind lifted by 5 against the one ahead
    near3 = sps.ttest_ind([43.0, 45.0], [40.0, 42.0], equal_var=False)  # LoRA + 5 vs full at eps = 3: inside
    near8 = sps.ttest_ind([35.0, 36.0], [44.0, 46.0], equal_var=False)  # LoRA + 5 vs full at eps = 8: outside
    assert (
        f"eps3: full ~ LoRA (BLEU within 5): **{_state(near3)}** (41.00 vs 39.00 BLEU, |gap| 2.00 against 5; "
        f"5 - |gap| = +3.00: t = {near3.statistic:+.2f} (Welch" in md
    )
    assert f"eps8: full ~ LoRA (BLEU within 5): **{_state(near8)}** (45.00 vs 30.50 BLEU, |gap| 14.50" in md
    assert _state(near3) == "agrees, not decided" and _state(near8) in (
        "contradicted",
        "disagrees, not decided",
    )
    lora_full = sps.ttest_ind([30.0, 31.0], [44.0, 46.0], equal_var=False)
    assert f"eps8: LoRA slightly ahead of full (BLEU): **{_state(lora_full)}**" in md
    full_rgp = sps.ttest_ind([40.0, 42.0], [35.0, 37.0], equal_var=False)
    assert f"eps3: full > RGP (BLEU): **{_state(full_rgp)}**" in md and "paper: 61.519 vs 58.482" in md
    top2 = sps.ttest_ind([24.0, 26.0], [14.0, 16.0], equal_var=False)
    assert f"eps8: top2 > retrain (BLEU): **{_state(top2)}**" in md and _state(top2) == "holds"
    lora_eps = sps.ttest_ind([30.0, 31.0], [38.0, 40.0], equal_var=False)
    assert f"lora: eps = 8 > eps = 3 (BLEU): **{_state(lora_eps)}**" in md
    rgp_eps = sps.ttest_ind([39.0, 41.0], [35.0, 37.0], equal_var=False)
    assert f"rgp: eps = 8 > eps = 3 (BLEU): **{_state(rgp_eps)}**" in md and "paper: 58.455 vs 58.482" in md
    assert "lora 12,288 (2.0 min a run)" in md
    lrs = "; ".join(_lr_words(m) for m in TRAINABLE)
    assert f"constant: {lrs} (private / non-private where they differ)" in md
    assert "Non-private test loss above full fine-tuning's at eps = 3 (2.00): prefix 5.00." in md
    assert b.loc[("full", "eps3"), "paper"] == pytest.approx(61.519)
    assert df[df.quantity == "test_loss"]["paper"].isna().all()
    assert f"p = {near3.pvalue:.2g} over 2 / 2 seeds" in md


def test_a_missing_method_leaves_its_claims_out(isolated_dirs):
    bleu = {("full", "independent", 3.0): (40.0,), ("lora", "independent", 3.0): (39.0,)}
    _store(isolated_dirs / "runs", bleu)
    li_e2e_methods.build(ReportContext())
    md = (isolated_dirs / "results" / "li_e2e_methods.md").read_text()
    assert "eps3: full ~ LoRA" in md and "full > prefix" not in md and "top2 > retrain" not in md
