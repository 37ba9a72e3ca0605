"""Li, Tramer, Liang & Hashimoto (ICLR 2022), E2E: BLEU / ROUGE-L of GPT-2 at eps = 3, eps = 8 and non-private.

Reads ``runs/li_e2e_<profile>`` (preset ``configs/experiment/li_e2e.yaml``): one column per privacy level
(``privacy.target_epsilon`` 3 / 8 with sigma calibrated under RDP, or ``noise=none``), rows BLEU and ROUGE-L
(the E2E scorer's definitions, :mod:`dp_adam_bench.tasks.e2e_metrics`) and the epsilon of each private run under
every accountant, beside the paper's. The exact accounting for the paper's own setting is in
``results/li_e2e_accounting.md``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from dp_adam_bench.report.aggregate import get
from dp_adam_bench.report.common import Claim, incomplete_note, load_paper, write_table
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.expected import preset_runs

TABLE_ID = "li_e2e"
COLUMNS = ("eps3", "eps8", "nonprivate")
METRICS = {"bleu": "test_bleu", "rouge_l": "test_rougeL"}
ACCOUNTANTS = {
    "rdp": "RDP (calibrated)",
    "gdp_clt": "Gaussian DP + CLT",
    "prv": "PRV (trade-off functions)",
    "pld": "PLD",
}


def column_of(cfg: dict) -> str | None:
    if get(cfg, "noise.kind") == "none":
        return "nonprivate"
    target = get(cfg, "privacy.target_epsilon")
    return {3.0: "eps3", 8.0: "eps8"}.get(float(target)) if target is not None else None


def build(ctx: ReportContext | None = None) -> list[Path]:
    ctx = ctx or ReportContext()
    profile = ctx.profile
    paper = load_paper("li")["e2e"]
    command = f"make reproduce-table TABLE={TABLE_ID} PROFILE={profile}"
    runs = preset_runs(ctx, TABLE_ID)
    complete, incomplete = runs.complete, runs.incomplete
    if not complete:
        raise FileNotFoundError(f"no complete runs in {ctx.where(runs.spec.name)}; run `{command}`")
    by_col: dict[str, list] = {c: [] for c in COLUMNS}
    for r in complete:
        col = column_of(r.config)
        if col is not None:
            by_col[col].append(r)

    rows = []
    ours: dict[tuple[str, str], float] = {}
    for metric, key in METRICS.items():
        for col in COLUMNS:
            vals = [float(r.summary["metrics"][key]) for r in by_col[col] if key in r.summary["metrics"]]
            mean = float(np.mean(vals)) if vals else None
            if mean is not None:
                ours[(metric, col)] = mean
            rows.append(
                {
                    "quantity": metric,
                    "column": col,
                    "paper": paper["metrics"][col][metric],
                    "ours": mean,
                    "ours_std": float(np.std(vals)) if vals else None,
                    "n": len(vals),
                }
            )
    for acc, label in ACCOUNTANTS.items():
        for col in ("eps3", "eps8"):
            vals = [
                float((r.summary.get("epsilon") or {}).get(acc))
                for r in by_col[col]
                if (r.summary.get("epsilon") or {}).get(acc) is not None
            ]
            rows.append(
                {
                    "quantity": f"epsilon, {label}",
                    "column": col,
                    "paper": (paper["accounting"][col] or {}).get(acc),
                    "ours": float(np.mean(vals)) if vals else None,
                    "ours_std": None,
                    "n": len(vals),
                }
            )
    for col in ("eps3", "eps8"):
        sig = [float(r.summary["sigma"]) for r in by_col[col] if r.summary.get("sigma") is not None]
        rows.append(
            {
                "quantity": "sigma (calibrated under RDP)",
                "column": col,
                "paper": None,
                "ours": float(np.mean(sig)) if sig else None,
                "ours_std": None,
                "n": len(sig),
            }
        )
    df = pd.DataFrame(rows)
    df["ours_minus_paper"] = df["ours"] - df["paper"]
    df["n"] = df["n"].astype("Int64")

    claims = []
    for metric in METRICS:
        if all((metric, c) in ours for c in COLUMNS):
            a, b, c = (ours[(metric, col)] for col in COLUMNS)
            claims.append(
                Claim(
                    f"{metric}: non-private > eps = 8 > eps = 3",
                    c > b > a,
                    f"{c:.2f} / {b:.2f} / {a:.2f} (paper {paper['metrics']['nonprivate'][metric]} / "
                    f"{paper['metrics']['eps8'][metric]} / {paper['metrics']['eps3'][metric]})",
                )
            )
    for col in ("eps3", "eps8"):
        eps = [(r.summary.get("epsilon") or {}) for r in by_col[col]]
        if eps:
            e = eps[0]
            claims.append(
                Claim(
                    f"{col}: the RDP-calibrated run costs less under GDP + CLT and PRV than under RDP "
                    "(as in the paper)",
                    e.get("gdp_clt", np.inf) < e["rdp"] and e.get("prv", np.inf) < e["rdp"],
                    f"RDP {e['rdp']:.3f}, GDP-CLT {e.get('gdp_clt', float('nan')):.3f}, "
                    f"PRV {e.get('prv', float('nan')):.3f}",
                )
            )
    cfg = complete[0].config
    setting = (
        f"profile {profile}: {get(cfg, 'task.name')}, expected B = {get(cfg, 'train.batch_size')}, "
        f"{complete[0].summary.get('steps')} Poisson steps, C = {get(cfg, 'privacy.clip')}, Adam lr "
        f"{get(cfg, 'optimizer.lr')}, delta = {get(cfg, 'privacy.delta')}, {get(cfg, 'train.clipping')} clipping, "
        f"{get(cfg, 'task.test_subset') or 'all'} test MRs decoded with {get(cfg, 'task.num_beams')} beams. Paper: "
        "pretrained GPT-2 (124M), B = 512, 50 epochs, all 630 test MRs."
    )
    notes = []
    if profile == "cpu":
        notes.append(
            "CPU profile: no pretrained GPT-2 exists offline, so this is a 2-layer GPT-2 TRAINED FROM SCRATCH "
            "for 150 steps of 32 pairs. Its BLEU / ROUGE-L are not comparable with the paper's (pretraining is "
            "what makes DP fine-tuning work there); only the orderings are checked. At this scale the noise on "
            "the averaged gradient (sigma C / B, over 13M coordinates) swamps the signal, so the private runs "
            "are expected to learn little: a negative result about from-scratch DP training, not about Li et al."
        )
    notes.append(
        "GDP + CLT is an approximation, not a bound (it can fall below the exact PLD value); PRV and PLD are "
        "numerical accountants of the same mechanism."
    )
    notes += incomplete_note(incomplete)
    return write_table(
        TABLE_ID,
        df,
        out=ctx.out,
        title="Li et al. — GPT-2 on E2E: BLEU / ROUGE-L at eps = 3, 8 and non-private",
        command=command,
        setting=setting,
        claims=claims,
        notes=notes,
        digits=3,
        missing=runs.missing,
    )
