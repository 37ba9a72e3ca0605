"""Tang & Lecuyer, the privacy budget behind Fig. 1 and Table 1: steps to eps = 7 and the DP bias Phi.

Algorithm 1 takes "total number of steps T = f(eps-DP, delta-DP, B, N, sigma)"; the paper tunes at eps ~ 7
and uses RDP for composition (§2, "Privacy Analysis"). For both settings this table gives the largest T (and
epochs, T B / N) with eps <= 7 under RDP, PRV and PLD, the epsilon spent at Table 1's SNLI checkpoints, and
the bias of Adam's second moment Phi = (sigma C / B)^2 (Eq. 3). An exact computation, the same at every
profile; paper numbers from ``configs/paper/tang.yaml``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from dp_adam_bench.privacy.accounting import epsilon, steps_to_epsilon
from dp_adam_bench.report.common import Claim, load_paper, write_table
from dp_adam_bench.report.context import ReportContext

#: why the budget's claims are exact: formulas and deterministic accountants
DIGITS_EXACT = (
    "Phi is a formula of the setting (no seeds); tolerance: the rounding of the paper's printed digits"
)
BUDGET_EXACT = "deterministic accountants (no seeds); eps <= the target exactly"

TABLE_ID = "tang_budget"
COMMAND = "make reproduce-table TABLE=tang_budget"
DATASETS = ("cifar10", "snli")
ACCOUNTANTS = ("rdp", "prv", "pld")


def phi(sigma: float, clip: float, batch_size: float) -> float:
    """Variance of the DP noise on each coordinate of the averaged gradient, Phi = (sigma C / B)^2
    (Tang & Lecuyer Eq. 3)."""
    return (sigma * clip / batch_size) ** 2


def _printed(value: float, paper: float) -> bool:
    """Equal at the 4 significant digits the paper prints (e.g. 2.441e-8)."""
    return f"{value:.3e}" == f"{paper:.3e}"


def budget_frame(settings: dict, checkpoints: list[int], paper_phi: dict) -> pd.DataFrame:
    """One row per (dataset, quantity, accountant): Phi (Eq. 3) beside the paper's, the steps and epochs to the
    target epsilon, and (SNLI) the epsilon spent at Table 1's checkpoints."""
    target, delta = float(settings["target_epsilon"]), float(settings["delta"])
    rows = []

    def add(common: dict, column: str, ours, accountant: str = "", ref: float | None = None, **extra) -> None:
        rows.append(
            {
                "row": common["dataset"],
                "column": column,
                "accountant": accountant,
                "paper": ref,
                "ours": ours,
                "ours_minus_paper": ours - ref if ref is not None else None,
                **{k: v for k, v in common.items() if k != "dataset"},
                **extra,
            }
        )

    for ds in DATASETS:
        s = settings[ds]
        n, clip, sigma, batch = int(s["N"]), float(s["clip"]), float(s["sigma"]), int(s["batch_size"])
        q = batch / n
        common = {"dataset": ds, "N": n, "batch_size": batch, "clip": clip, "sigma": sigma, "q": q}
        add(common, "phi", phi(sigma, clip, batch), ref=paper_phi.get(ds))
        for acc in ACCOUNTANTS:
            steps = steps_to_epsilon(target, sigma, q, delta, acc)
            add(common, f"steps_to_eps{target:g}", steps, acc)
            add(common, f"epochs_to_eps{target:g}", steps * q, acc)
        if ds == "snli":
            for t in checkpoints:
                for acc in ACCOUNTANTS:
                    add(common, f"eps_at_t{t}", epsilon(sigma, q, t, delta, acc), acc, epochs=t * q)
    df = pd.DataFrame(rows)
    df["ours"] = pd.Series([r["ours"] for r in rows], dtype=object)  # step counts stay integers
    return df


def _cell(df: pd.DataFrame, ds: str, column: str, acc: str = "") -> float:
    sub = df[(df.row == ds) & (df.column == column) & (df.accountant == acc)]
    return float(sub.ours.iloc[0])


def _claims(
    df: pd.DataFrame, paper_phi: dict, checkpoints: list[int], target: float, delta: float
) -> list[Claim]:
    phi_snli = _cell(df, "snli", "phi")
    claims = [
        Claim.exact(
            f"SNLI Phi = (sigma C / B)^2 is {paper_phi['snli']:.3e} (Table 1), to the printed digits",
            _printed(phi_snli, paper_phi["snli"]),
            f"ours {phi_snli:.6e}",
            DIGITS_EXACT,
        )
    ]
    for t in checkpoints:
        eps = {acc: _cell(df, "snli", f"eps_at_t{t}", acc) for acc in ACCOUNTANTS}
        detail = ", ".join(f"{acc} eps = {v:.2f}" for acc, v in eps.items())
        for acc, label in (("rdp", "RDP, the paper's accountant"), ("pld", "PLD, the tightest here")):
            claims.append(
                Claim.exact(
                    f"SNLI Table 1 step t = {t} is within eps = {target:g}, delta = {delta:g} ({label})",
                    bool(eps[acc] <= target),
                    detail,
                    BUDGET_EXACT,
                )
            )
    return claims


def _notes(df: pd.DataFrame, checkpoints: list[int], target: float) -> list[str]:
    key = f"steps_to_eps{target:g}"
    ratio = {ds: _cell(df, ds, key, "pld") / _cell(df, ds, key, "rdp") for ds in DATASETS}
    return [
        "Steps: the largest T with eps(T) <= target for Poisson sampling at q = B / N (dp_adam_bench.privacy."
        "accounting.steps_to_epsilon); epochs = T q, i.e. T expected batches of B over N examples.",
        "RDP is what Tang & Lecuyer composed with. Its looseness depends on sigma: the PLD/PRV budgets allow "
        + ", ".join(f"{ratio[ds]:.2f}x as many steps for {ds}" for ds in DATASETS)
        + " (SNLI's sigma = 0.4 is where RDP's conversion to (eps, delta) is loosest).",
        "PRV (Opacus, central estimate) and PLD (dp-accounting, pessimistic) agree to a step or so.",
        f"Table 1 reports SNLI moments at t = {', '.join(str(t) for t in checkpoints)}: the eps_at_t rows "
        "give the privacy those checkpoints have spent, under each accountant, with the paper's delta.",
        f"CIFAR-10 Phi = {_cell(df, 'cifar10', 'phi'):.3e} has no printed counterpart in the paper.",
    ]


def _setting_text(settings: dict, target: float, delta: float) -> str:
    return (
        "; ".join(
            f"{ds}: N = {c['N']}, C = {c['clip']:g}, sigma = {c['sigma']:g}, B = {c['batch_size']}"
            for ds, c in ((ds, settings[ds]) for ds in DATASETS)
        )
        + f"; delta = {delta:g}, target eps = {target:g} (tang.yaml)."
    )


def build(ctx: ReportContext | None = None) -> list[Path]:
    """Write ``<ctx.out>/tang_budget.{csv,md}``. Exact: the same at every profile."""
    ctx = ctx or ReportContext()
    paper = load_paper("tang")
    settings = paper["settings"]
    target, delta = float(settings["target_epsilon"]), float(settings["delta"])
    checkpoints = sorted({int(r["t"]) for r in paper["table1"]["rows"]})
    paper_phi = {"snli": float(paper["table1"]["phi"])}  # Table 1 is SNLI only
    df = budget_frame(settings, checkpoints, paper_phi)
    return write_table(
        TABLE_ID,
        df,
        out=ctx.out,
        title="Tang & Lecuyer — steps to eps = 7 and the DP bias Phi",
        command=COMMAND,
        setting=_setting_text(settings, target, delta),
        claims=_claims(df, paper_phi, checkpoints, target, delta),
        notes=_notes(df, checkpoints, target),
    )
