"""The learning rates a CPU table runs are the ones its pilots chose: each preset's ``profiles.cpu.lr`` against the
rows marked chosen in the committed pilot table (``results/<table>_pilots.csv``, written by
dp_adam_bench/report/pilots.py from the pilot runs). A preset edited by hand, or pilots re-run and re-reported
without the preset following, fails here."""

from __future__ import annotations

import math

import pandas as pd
import yaml

from dp_adam_bench.paths import REPO_ROOT


def cpu_lr(preset: str) -> dict:
    cfg = yaml.safe_load((REPO_ROOT / "configs" / "experiment" / f"{preset}.yaml").read_text())
    return cfg["profiles"]["cpu"]["lr"]


def chosen(table: str, keys: list[str]) -> dict[tuple, float]:
    """``{(value of each key): chosen lr}`` of the pilot table's chosen rows (blank cells read as "")."""
    frame = pd.read_csv(REPO_ROOT / "results" / f"{table}.csv", keep_default_na=False)
    rows = frame[frame["chosen"] == "yes"]
    out = {tuple(str(r[k]) for k in keys): float(r["lr"]) for _, r in rows.iterrows()}
    assert len(out) == len(rows), f"{table}: two chosen rows for one group"
    return out


def same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def test_li_glue_runs_the_learning_rates_its_pilots_chose():
    lr = cpu_lr("li_glue")
    picks = chosen("li_glue_pilots", ["objective", "finetune", "noise", "sigma"])
    # a private row's lr serves both columns: the pilots at both sigmas (infilling: at eps = 8's only) chose it
    want = {
        "classifier": [picks[("classifier", "", "independent", s)] for s in ("0.5834", "0.8322")],
        "classifier_nonprivate": [picks[("classifier", "", "none", "0.0")]],
        "infilling": [picks[("infilling", "", "independent", "0.5834")]],
        "infilling_nonprivate": [picks[("infilling", "", "none", "0.0")]],
        "head": [picks[("classifier", "head", "independent", s)] for s in ("0.5834", "0.8322")],
        "head_nonprivate": [picks[("classifier", "head", "none", "0.0")]],
    }
    for row, values in want.items():
        assert all(same(lr[row], v) for v in values), (row, lr[row], values)


def test_li_e2e_methods_runs_the_learning_rates_its_pilots_chose():
    lr = cpu_lr("li_e2e_methods")
    picks = chosen("li_e2e_methods_pilots", ["finetune", "pretrained", "noise"])
    # the pilots' group of each of the table's rows (retrain: full fine-tuning from a random start); a private
    # row's lr, piloted at eps = 8's sigma, serves both private columns
    for method in ("full", "lora", "prefix", "rgp", "top2", "retrain"):
        finetune, pretrained = ("full", "False") if method == "retrain" else (method, "")
        assert same(lr[method], picks[(finetune, pretrained, "independent")]), method
        assert same(lr[f"{method}_nonprivate"], picks[(finetune, pretrained, "none")]), method
