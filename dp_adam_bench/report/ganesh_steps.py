"""The step each private variant of Ganesh et al. Fig. 3 actually takes, from its runs' logged second moments.

When the noise variance Phi = (sigma C / B)^2 a coordinate of v^ carries dwarfs the clean second moment (Ganesh,
McMahan & Thakurta 2025, arXiv:2507.01129, §4.4 and Fig. 6), every Adam variant's denominator is nearly the same
for every coordinate, and the variant acts as DP-SGD with momentum at an *effective step*: the factor a steady
privatized gradient g is multiplied by in the update. Per variant (its denominator at a coordinate with the logged
quantile of v^, Alg. 5-7 of the paper):

* post-processing (Alg. 5): eta / (sqrt(v^) + eps);
* bias correction (Alg. 7): eta / sqrt(max(v^ - Phi, eps_s^2));
* independent moment estimation (Alg. 6): eta / (sqrt(max(v^, 0)) + eps_s);
* DP-SGD with heavy-ball momentum mu (b <- mu b + g): lr / (1 - mu), the same for every coordinate.

Adam's first moment is an average (m^ -> g), SGD's buffer a sum (b -> g / (1 - mu)), hence the 1 / (1 - mu).
The table gives each variant's effective step at the median coordinate and at the quartiles (the larger v^, the
smaller the step), averaged over the logged rounds and seeds; the reading says whether, within a column, the test
loss falls as the median effective step grows (a Spearman rank correlation over the private rows), that is,
whether at this horizon the variants differ mostly by how far they step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd

from dp_adam_bench.report.aggregate import get

#: optimizer name -> its denominator at a coordinate whose logged quantile is ``q`` ("q1" | "median" | "q3")
STEP_RULES: dict[str, Callable[[dict, dict, str], float | None]] = {}


def rule(name: str):
    def register(fn):
        STEP_RULES[name] = fn
        return fn

    return register


def _sqrt_v_plus_eps(eps_key: str, default: float):
    """Post-processing (Alg. 5: eps) and IME (Alg. 6: eps_s): eta / (sqrt(max(v^, 0)) + eps)."""

    def step(cfg: dict, diag: dict, q: str) -> float | None:
        v = diag.get(f"diag/v_private_{q}")
        eps = float(get(cfg, eps_key) or default)
        return None if v is None else float(get(cfg, "optimizer.lr")) / (math.sqrt(max(v, 0.0)) + eps)

    return step


STEP_RULES["adam"] = _sqrt_v_plus_eps("optimizer.eps", 1e-8)
STEP_RULES["ime"] = _sqrt_v_plus_eps("optimizer.eps_s", 1e-4)


@rule("bc")
def _bias_correction(cfg: dict, diag: dict, q: str) -> float | None:
    v = diag.get(f"diag/v_private_minus_phi_{q}")
    floor = float(get(cfg, "optimizer.eps_s") or 1e-4) ** 2
    return None if v is None else float(get(cfg, "optimizer.lr")) / math.sqrt(max(v, floor))


@rule("sgd")
def _sgd_momentum(cfg: dict, diag: dict, q: str) -> float | None:
    del diag, q
    return float(get(cfg, "optimizer.lr")) / (1.0 - float(get(cfg, "optimizer.momentum") or 0.0))


def _mean_over_rounds(metrics: list[dict]) -> dict:
    """Each diag/ key's mean over the logged rounds."""
    sums: dict[str, list[float]] = {}
    for m in metrics:
        for k, v in m.items():
            if k.startswith("diag/") and v is not None and math.isfinite(float(v)):
                sums.setdefault(k, []).append(float(v))
    return {k: float(np.mean(v)) for k, v in sums.items()}


def effective_steps(records, place: Callable[[dict], tuple[str | None, str | None]]) -> pd.DataFrame:
    """One row per (row, column) of the private variants with a rule: the effective step at the median coordinate
    and at the quartiles of v^ (q3 -> the smaller step), mean over the runs (seeds) and their logged rounds, and
    the runs' mean test_loss. ``place(cfg) -> (row, column)``."""
    found: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    for r in records:
        cfg = r.config
        name = get(cfg, "optimizer.name")
        if name not in STEP_RULES or get(cfg, "noise.kind") == "none":
            continue
        row, col = place(cfg)
        if row is None or col is None:
            continue
        diag = _mean_over_rounds(r.metrics())
        steps = [STEP_RULES[name](cfg, diag, q) for q in ("median", "q3", "q1")]
        if any(s is None for s in steps):
            continue
        phi, clean = diag.get("diag/phi"), diag.get("diag/v_clean_median")
        ratio = clean / phi if phi and clean is not None else math.nan
        found.setdefault((row, col), []).append((*steps, ratio, float(r.summary["metrics"]["test_loss"])))
    rows = []
    for (row, col), vals in sorted(found.items()):
        a = np.asarray(vals)
        rows.append(
            {
                "row": row,
                "column": col,
                "effective step (median coordinate)": float(a[:, 0].mean()),
                "at q3 of v^": float(a[:, 1].mean()),
                "at q1 of v^": float(a[:, 2].mean()),
                "median clean v / Phi": float(a[:, 3].mean()),
                "test_loss": float(a[:, 4].mean()),
                "n": len(vals),
            }
        )
    return pd.DataFrame(rows)


def _spearman(steps: pd.Series, losses: pd.Series) -> float:
    # equal steps reached by different formulas (3e-4 / 1e-4 and 0.3 / (1 - 0.9)) tie, not rank by rounding error
    x = pd.Series([float(f"{v:.6g}") for v in steps])
    return float(x.corr(pd.Series(losses.to_numpy()), method="spearman"))


STEP = "effective step (median coordinate)"


def order_reading(steps: pd.DataFrame, columns: list[str]) -> str | None:
    """Spearman rank correlations between the median effective step and the test loss (-1: the larger the step,
    the lower the loss, for every pair): within each row across the columns (one variant under the three noises)
    wherever its step varies, and within each column across the private rows. None without 3 cells to rank."""
    by_row, by_col = [], []
    for row in sorted(set(steps.row)):
        r = steps[steps.row == row]
        if len(r) >= 3 and r[STEP].nunique() == len(r):
            pairs = ", ".join(f"{s:.2g} -> {loss:.3f}" for s, loss in zip(r[STEP], r.test_loss, strict=True))
            by_row.append(f"{row} rho {_spearman(r[STEP], r.test_loss):+.2f} ({pairs})")
    for col in columns:
        c = steps[steps.column == col]
        if len(c) >= 3 and c[STEP].nunique() > 1:
            order = ", ".join(f"{r} {s:.2g}" for r, s in zip(c.row, c[STEP], strict=True))
            by_col.append(f"{col} rho {_spearman(c[STEP], c.test_loss):+.2f} ({order})")
    if not by_row and not by_col:
        return None
    ratio = steps["median clean v / Phi"].dropna()
    noise = (
        f" (here the median clean v is {ratio.max():.1g} of Phi or less in every Adam run)"
        if len(ratio)
        else ""
    )
    out = (
        "Effective steps (the section above; clean diagnostics of the private runs, not private outputs): where "
        f"v^ is mostly noise{noise}, an Adam variant acts as DP-SGD with momentum at its effective step, and "
        "the noise sets that step. Spearman rho between the median effective step and the test loss (-1: larger "
        "step, lower loss)"
    )
    if by_row:
        out += "; one variant across the columns (step -> loss): " + "; ".join(by_row)
    if by_col:
        out += "; the variants within a column: " + "; ".join(by_col)
    spread = steps["at q1 of v^"] / steps["at q3 of v^"]
    wide = sorted(set(steps.row[spread > 10]))
    if wide:
        out += (
            f". Not uniform across coordinates (q1 / q3 step > 10): {', '.join(wide)}, so the median step "
            "describes them less well"
        )
    return out + "."
