"""Ganesh, McMahan & Thakurta §5.2, Fig. 3 against the number of steps: from which horizon do its claims hold here?

Fig. 3's claims are made at ~2,000 steps (B = 2048); the CPU profile of ``ganesh_fig3`` runs 32. This table reads
the preset ``ganesh_fig3_horizon`` (the same setting with more training abstracts at the same number of epochs:
each example participates as often, so the epsilon is the same at every horizon, and only the number of steps
grows) together with ``ganesh_fig3``'s own runs as the shortest horizon. Within each (row, column, horizon) the
preset's selection rule picks the setting (the paper's: the lowest mean loss over seeds). Two gaps are followed as
the horizon grows, each with its standard error over seeds:

* STP - post-processing (Alg. 8 against plain DP-Adam, independent noise at BandMF's sigma): the paper finds it
  negative (scale-then-privatize has the lowest loss);
* BandMF - DP-SGD for post-processing DP-Adam at the same epsilon: the paper finds it negative.

The paper profile adds the other cells of its main comparisons (BC, STP under BandMF, DP-SGD with momentum) and
their gaps. For each gap the report states the first horizon from which it has the paper's sign beyond two
standard errors at every longer horizon, or that it does not within the horizons run, and what a straight line
through the gap against log2(steps) says (an extrapolation, labelled as one). The diagnostics that explain STP
(its scaled per-example norms against its clip, the fraction clipped, where sqrt(v^) exceeds eps_s1) and BC / IME
(the fraction of negative v^ - Phi coordinates, Ganesh §4.4) are tabulated per horizon from the run logs.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from dp_adam_bench.report.aggregate import Cell, difference_se, get, select_cells
from dp_adam_bench.report.common import Claim, incomplete_note, markdown_table, save_figure, write_table
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.expected import preset_runs
from dp_adam_bench.report.ganesh_fig3 import (
    COLUMN_LABELS,
    COLUMNS,
    ROW_LABELS,
    column_of,
    profile_setting,
    row_of,
)

TABLE_ID = "ganesh_fig3_horizon"
PRESET = "ganesh_fig3_horizon"
BASE = "ganesh_fig3"
LOW, BANDMF, HIGH = COLUMNS

#: (name, what, first cell, second cell): the gap is loss(first) - loss(second); the paper finds every one < 0
GAPS = (
    ("stp_minus_pp", "STP - post-processing, DP-SGD noise at BandMF's sigma", ("stp", HIGH), ("postprocessing", HIGH)),
    ("bandmf_minus_dpsgd", "BandMF - DP-SGD (same epsilon), post-processing", ("postprocessing", BANDMF),
     ("postprocessing", HIGH)),
    ("stp_minus_pp_bandmf", "STP - post-processing, BandMF", ("stp", BANDMF), ("postprocessing", BANDMF)),
    ("bc_bandmf_minus_dpsgd", "BandMF - DP-SGD (same epsilon), bias correction", ("bc", BANDMF), ("bc", HIGH)),
    ("pp_minus_sgd", "post-processing - DP-SGD with momentum, DP-SGD noise at BandMF's sigma",
     ("postprocessing", HIGH), ("dpsgd_momentum", HIGH)),
)  # fmt: skip
#: the diagnostics tabulated per (row, column, horizon): the last logged value, averaged over the chosen runs
DIAGNOSTICS = (
    ("diag/frac_clipped", "fraction clipped"),
    ("diag/norm_over_clip_median", "median per-example norm / C"),
    ("diag/stp_frac_sqrtv_above_eps_s1", "STP: fraction sqrt(v^) > eps_s1"),
    ("diag/stp_scale_max", "STP: max scale"),
    ("diag/stp_scale_min", "STP: min scale"),
    ("diag/frac_negative_after_bc", "fraction v^ - Phi < 0"),
)


def steps_of(train_subset, setting: dict) -> int:
    """The number of steps a run of ``train_subset`` abstracts makes at the profile's epochs and batch size."""
    return int(setting["epochs"]) * int(train_subset) // int(setting["batch_size"])


def horizon_cells(records, selection, setting: dict) -> dict[tuple[str, str, int], Cell]:
    """{(row, column, steps): Cell}: the selection rule per (optimizer, noise, sigma, training abstracts)."""
    low, high = float(setting["sigma_low"]), float(setting["sigma_high"])

    def locate(cfg):
        subset = get(cfg, "task.train_subset")
        steps = steps_of(subset, setting) if subset is not None else None
        return row_of(cfg), column_of(cfg, low, high), steps

    return select_cells(records, selection, locate)


def gap_table(cells: dict) -> pd.DataFrame:
    """Every gap at every horizon where both of its cells are: the difference, its standard error over seeds and
    whether it is beyond seed noise (|d| > 2 SE) with the paper's sign."""
    rows = []
    for name, what, a, b in GAPS:
        for h in sorted({k[2] for k in cells}):
            ca, cb = cells.get((*a, h)), cells.get((*b, h))
            if ca is None or cb is None:
                continue
            d = ca.mean - cb.mean
            se = difference_se(ca.std, ca.n, cb.std, cb.n)
            rows.append(
                {
                    "gap": name,
                    "what": what,
                    "steps": h,
                    "difference": d,
                    "se": se,
                    "n": min(ca.n, cb.n),
                    "verdict": _verdict(d, se),
                }
            )
    return pd.DataFrame(rows, columns=["gap", "what", "steps", "difference", "se", "n", "verdict"])


def _verdict(d: float, se: float | None) -> str:
    if se is None or not math.isfinite(d):
        return "fewer than 2 seeds"
    if abs(d) <= 2 * se:
        return "within seed noise"
    return "paper's sign" if d < 0 else "against the paper"


def trend(steps: list[int], diffs: list[float]) -> tuple[float, float | None] | None:
    """Least-squares line through (log2 steps, gap): the change per doubling of the steps and, when the line
    moves toward the paper's sign (down) from a positive gap, the horizon where it would cross zero
    (an extrapolation). None with fewer than two horizons."""
    if len(steps) < 2:
        return None
    x = np.log2(np.asarray(steps, dtype=float))
    slope, intercept = np.polyfit(x, np.asarray(diffs, dtype=float), 1)
    crossing = None
    if slope < 0 and diffs[-1] > 0:
        at = -intercept / slope  # log2 of the steps
        crossing = float(2.0**at) if at < 60 else None  # beyond 2^60 steps is no horizon
    return float(slope), crossing


def gap_claims(gaps: pd.DataFrame) -> list[Claim]:
    """Per gap: the first horizon from which it has the paper's sign beyond 2 SE at every longer horizon run."""
    claims = []
    for name, what, _, _ in GAPS:
        g = gaps[gaps.gap == name].sort_values("steps")
        if g.empty:
            continue
        good = list(g.verdict == "paper's sign")
        first = next((i for i in range(len(good)) if all(good[i:])), None)
        per = "; ".join(
            f"{s} steps: {d:+.4f}" + ("" if se is None or pd.isna(se) else f" ± {se:.4f}")
            for s, d, se in zip(g.steps, g.difference, g.se, strict=True)
        )
        fit = trend(list(g.steps), list(g.difference))
        if fit is not None:
            per += f"; trend {fit[0]:+.4f} per doubling of the steps"
            if fit[1] is not None:
                per += f" (a straight line would cross zero near {fit[1]:,.0f} steps: an extrapolation)"
        holds = first is not None
        where = f"from {int(g.steps.iloc[first])} steps on" if holds else "at none of the horizons run"
        claims.append(
            Claim(f"[ours] {what}: negative (the paper's sign) beyond seed noise {where}", holds, per)
        )
    return claims


def _chosen_runs(records, cell: Cell, place, setting: dict) -> list:
    """The runs behind ``cell``: its group's runs at the chosen setting."""
    low, high = float(setting["sigma_low"]), float(setting["sigma_high"])
    out = []
    for r in records:
        cfg = r.config
        subset = get(cfg, "task.train_subset")
        here = (
            row_of(cfg),
            column_of(cfg, low, high),
            steps_of(subset, setting) if subset is not None else None,
        )
        if here == place and all(get(cfg, k) == v for k, v in cell.chosen.items()):
            out.append(r)
    return out


def diagnostics_table(records, cells: dict, setting: dict) -> pd.DataFrame:
    """The last logged value of each diagnostic, averaged over the chosen runs of every (row, column, horizon)."""
    rows = []
    for place in sorted(cells, key=lambda p: (p[0], COLUMNS.index(p[1]), p[2])):
        runs = _chosen_runs(records, cells[place], place, setting)
        line = {"row": place[0], "column": place[1], "steps": place[2]}
        logs = [r.metrics() for r in runs]  # each run's metrics file read once
        for key, label in DIAGNOSTICS:
            vals = [v for v in (_last(m, key) for m in logs) if v is not None]
            if vals:
                line[label] = float(np.mean(vals))
        if len(line) > 3:
            rows.append(line)
    return pd.DataFrame(rows)


def _last(metrics: list[dict], key: str) -> float | None:
    for m in reversed(metrics):
        if key in m:
            return float(m[key])
    return None


def build(ctx: ReportContext | None = None) -> list[Path]:
    ctx = ctx or ReportContext()
    profile = ctx.profile
    command = f"make reproduce-table TABLE={TABLE_ID} PROFILE={profile}"
    runs, base = preset_runs(ctx, PRESET), preset_runs(ctx, BASE)
    setting = profile_setting(profile)
    # the base table's runs of the cells this study follows are its shortest horizon
    followed = {(p["optimizer"], p["noise"], float(p["privacy.sigma"])) for p in runs.spec.points()}
    shortest = [
        r
        for r in base.complete
        if (
            get(r.config, "optimizer.name"),
            get(r.config, "noise.kind"),
            float(get(r.config, "privacy.sigma") or 0),
        )
        in followed
    ]
    records = shortest + runs.complete
    if not records:
        raise FileNotFoundError(f"no complete runs in {ctx.where(runs.spec.name)}; run `{command}`")
    cells = horizon_cells(records, runs.spec.selection, setting)
    missing = runs.missing + [
        m
        for opt, noise, sigma in sorted(followed)
        for m in base.lacking(optimizer=opt, noise=noise, **{"privacy.sigma": sigma})
    ]

    table = []
    for (row, col, h), c in sorted(
        cells.items(), key=lambda kv: (kv[0][2], kv[0][0], COLUMNS.index(kv[0][1]))
    ):
        table.append(
            {
                "steps": h,
                "row": row,
                "column": col,
                "test_loss": c.mean,
                "std": c.std,
                "n": c.n,
                "chosen": ", ".join(
                    f"{k.split('.')[-1]}={v:g}" for k, v in c.chosen.items() if v is not None
                ),
            }
        )
    df = pd.DataFrame(table)
    gaps = gap_table(cells)
    claims = gap_claims(gaps)
    diag = diagnostics_table(records, cells, setting)
    fig = _figure(cells, gaps, ctx.out)
    horizons = sorted({k[2] for k in cells})
    return write_table(
        TABLE_ID,
        df,
        out=ctx.out,
        title="Ganesh et al. Fig. 3 against the number of steps: test loss and the claims' gaps",
        command=command,
        setting=_setting_text(profile, setting, horizons, runs.spec),
        claims=claims,
        notes=_notes(profile, records, cells, runs.incomplete + base.incomplete),
        figure=fig,
        digits=4,
        extra_sections=[
            (
                "The gaps (first - second; the paper finds each negative; 'beyond seed noise' = |d| > 2 SE)",
                markdown_table(gaps, 4) if len(gaps) else "(no horizon has both cells of a gap yet)",
            ),
            (
                "Diagnostics per horizon (last logged step, mean over the chosen runs; clean statistics: "
                "diagnostic, not private outputs)",
                markdown_table(diag, 4) if len(diag) else "(no diagnostics logged)",
            ),
        ],
        missing=missing,
    )


def _setting_text(profile: str, s: dict, horizons: list[int], spec) -> str:
    seeds = len(spec.seeds or [0])
    return (
        f"profile {profile}: the ganesh_fig3 setting ({s['max_length']} tokens, B = {s['batch_size']}, "
        f"{s['epochs']} epochs, BandMF b = {s['bands']}, sigma {s['sigma_high']:g} for DP-SGD at "
        f"BandMF's epsilon and for BandMF) at {', '.join(map(str, horizons))} steps (more training abstracts, "
        f"the same epochs: the same epsilon at every horizon); the shortest horizon is ganesh_fig3's own runs. "
        f"{seeds} seeds per setting; each cell's settings (clip included) in its 'chosen' column. Rows and "
        "columns are ganesh_fig3's: "
        + "; ".join(f"{c} = {COLUMN_LABELS[c]}" for c in COLUMNS if c != LOW)
        + "."
    )


def _notes(profile: str, records, cells, incomplete) -> list[str]:
    notes = []
    if profile == "cpu":
        notes.append(
            "CPU profile: every horizon uses the settings ganesh_fig3_tuning chose at 32 steps (eta, eps_s1 per "
            "column for STP); they are NOT re-tuned at each horizon (the CPU cannot afford a grid at every horizon). "
            "A longer horizon usually wants a smaller eta, so the longer horizons may be under-tuned; the paper "
            "profile tunes every cell at every horizon."
        )
    eps = {}
    for r in records:
        subset = get(r.config, "task.train_subset")
        found = (r.summary or {}).get("epsilon") or {}
        if found and get(r.config, "optimizer.name") == "adam":
            eps.setdefault(subset, found.get("pld", next(iter(found.values()))))
    if eps:
        notes.append(
            "Epsilon of the plain mechanism at each horizon (from the run ledgers, training abstracts: epsilon): "
            + ", ".join(f"{k}: {v:.4g}" for k, v in sorted(eps.items()))
            + " (the same participations at every horizon, so the same epsilon)."
        )
    notes += incomplete_note(incomplete)
    notes.append(
        "Rows: "
        + "; ".join(f"{r} = {ROW_LABELS[r]}" for r in sorted({k[0] for k in cells}) if r in ROW_LABELS)
    )
    return notes


def _figure(cells: dict, gaps: pd.DataFrame, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for row, col in sorted({k[:2] for k in cells}):
        pts = sorted((h, c) for (r, co, h), c in cells.items() if (r, co) == (row, col))
        axes[0].errorbar(
            [h for h, _ in pts],
            [c.mean for _, c in pts],
            yerr=[c.std for _, c in pts],
            marker="o",
            capsize=3,
            label=f"{row} @ {col}",
        )
    axes[0].set(xscale="log", xlabel="steps", ylabel="test loss (mean ± std over seeds)", title="test loss")
    axes[0].legend(fontsize=7)
    for name, what, _, _ in GAPS:
        g = gaps[gaps.gap == name].sort_values("steps")
        if g.empty:
            continue
        se = [0.0 if s is None or pd.isna(s) else 2 * s for s in g.se]
        axes[1].errorbar(g.steps, g.difference, yerr=se, marker="o", capsize=3, label=what)
    axes[1].axhline(0.0, color="k", lw=0.8)
    axes[1].set(
        xscale="log",
        xlabel="steps",
        ylabel="gap (± 2 SE over seeds)",
        title="the claims' gaps (the paper: below 0)",
    )
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, TABLE_ID, out)
