"""Tang & Lecuyer Fig. 2: histograms of clean vs private Adam moments and updates on SNLI.

From the coordinate samples the diagnostics save (``diagnostics/step_<t>.npz``) in the DP-Adam-Biased runs of
``runs/tang_fig1_snli_<profile>``, at the last logged step of the first seed: m^c vs m^p; v^c, v^p, v^p - Phi;
and the updates m^c / sqrt(v^c), m^c / sqrt(v^p), m^c / sqrt(v^p - Phi) (the last on the coordinates where
v^p > Phi). The paper's message: the noise bias in v^p shrinks every update towards the same small size
(the "sign-descent-like" private update), and subtracting Phi restores the clean update's spread. Everything
here is diagnostic (clean gradients), not a private output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from dp_adam_bench.report import stats
from dp_adam_bench.report.common import Claim, save_figure, write_table
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.restate import Restatement, register
from dp_adam_bench.report.skeleton import restated_rule_notes, rule_notes
from dp_adam_bench.report.tang_table1 import diag_runs

TABLE_ID = "tang_fig2"
ARRAYS = {
    "m_clean": "m^c",
    "m_private": "m^p",
    "v_clean": "v^c",
    "v_private": "v^p",
    "v_private_minus_phi": "v^p - Phi",
    "update_clean": "m^c / sqrt(v^c)",
    "update_private_v": "m^c / sqrt(v^p)",
    "update_corrected_v": "m^c / sqrt(v^p - Phi)",
}


def load_sample(runs) -> tuple[dict[str, np.ndarray], int, str]:
    """The last saved coordinate sample of the first run (lowest seed) that has one."""
    for r in sorted(runs, key=lambda r: r.config.get("seed", 0)):
        files = sorted((r.path / "diagnostics").glob("step_*.npz"), key=lambda p: int(p.stem.split("_")[1]))
        if files:
            with np.load(files[-1]) as z:
                arrays = {k: z[k].astype(np.float64) for k in z.files}
            return arrays, int(files[-1].stem.split("_")[1]), r.path.name
    raise FileNotFoundError(
        "no diagnostics/step_<t>.npz in the runs: set diagnostics.every > 0 and diagnostics.histograms=true"
    )


def build(ctx: ReportContext | None = None) -> list[Path]:
    ctx = ctx or ReportContext()
    profile = ctx.profile
    runs, _, missing = diag_runs(ctx)
    a, step, run_name = load_sample(runs)
    keep = a["v_private_minus_phi"] > 0  # m^c / sqrt(v^p - Phi) is defined there only
    rows = []
    for key, label in ARRAYS.items():
        x = a[key][keep] if key == "update_corrected_v" else a[key]
        ax = np.abs(x)
        rows.append(
            {
                "quantity": label,
                "coordinates": int(x.size),
                "median |x|": float(np.median(ax)),
                "q90 |x|": float(np.quantile(ax, 0.9)),
                "max |x|": float(ax.max()),
                "fraction < 0": float((x < 0).mean()),
            }
        )
    df = pd.DataFrame(rows)
    claims = claims_from_frame(df)
    fig = _figure(a, keep, step, ctx.out)
    return write_table(
        TABLE_ID,
        df,
        out=ctx.out,
        title="Tang & Lecuyer Fig. 2 — clean vs private Adam moments and updates (SNLI, DP-Adam-Biased)",
        command=f"make reproduce-table TABLE={TABLE_ID} PROFILE={profile}",
        setting=f"profile {profile}: run {run_name}, step {step}, a seeded sample of {a['m_clean'].size} "
        "coordinates of the trained parameters.",
        claims=claims,
        notes=[
            *rule_notes(claims, WHAT),
            "Diagnostic quantities (clean gradients); not private outputs.",
            "The paper shows these histograms at t = 5000 / 20000 of BERT-base training; ours come from the short "
            "run of tang_fig1_snli (see results/tang_fig1_snli.md for its setting).",
        ],
        figure=fig,
        digits=4,
        missing=missing,
    )


def _figure(a: dict, keep: np.ndarray, step: int, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def logabs(x):
        x = np.abs(x[x != 0])
        return np.log10(x)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key in ("m_clean", "m_private"):
        axes[0].hist(logabs(a[key]), bins=80, alpha=0.5, label=ARRAYS[key])
    axes[0].set(xlabel="log10 |m|", title=f"first moments, step {step}")
    for key in ("v_clean", "v_private"):
        axes[1].hist(logabs(a[key]), bins=80, alpha=0.5, label=ARRAYS[key])
    pos = a["v_private_minus_phi"][a["v_private_minus_phi"] > 0]
    axes[1].hist(np.log10(pos), bins=80, alpha=0.5, label="v^p - Phi (> 0 only)")
    axes[1].set(xlabel="log10 v", title="second moments")
    for key in ("update_clean", "update_private_v"):
        axes[2].hist(logabs(a[key]), bins=80, alpha=0.5, label=ARRAYS[key])
    axes[2].hist(
        logabs(a["update_corrected_v"][keep]), bins=80, alpha=0.5, label=ARRAYS["update_corrected_v"]
    )
    axes[2].set(xlabel="log10 |update|", title="updates (per coordinate)")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.set_ylabel("coordinates (sample)")
    fig.tight_layout()
    return save_figure(fig, TABLE_ID, out)


WHAT = "the moments of one run"
#: why the claims are untested: they read the coordinate sample of one run
ONE_RUN = (
    "no test: one run's coordinate sample (the run in the setting, one seed), so no spread over seeds; each seed's "
    "sample would test it"
)


def claims_from_frame(frame: pd.DataFrame) -> list[Claim]:
    """The figure's two statements on the table's own medians (its CSV holds what they read): untested, since they
    read one run; their detail says whether that run goes the paper's way."""
    rows = {r["quantity"]: r for r in frame.to_dict("records")}
    med = {q: float(r["median |x|"]) for q, r in rows.items()}
    kept = rows["m^c / sqrt(v^p - Phi)"]["coordinates"] / rows["m^c"]["coordinates"]

    def way(ok: bool) -> str:
        return "the paper's direction in this run" if ok else "against the paper's direction in this run"

    shrink = med["m^c / sqrt(v^p)"] < med["m^c / sqrt(v^c)"] / 10
    back = med["m^c / sqrt(v^p - Phi)"] > med["m^c / sqrt(v^p)"]
    return [
        Claim.compared(
            "the noise bias shrinks the update: median |m^c / sqrt(v^p)| < median |m^c / sqrt(v^c)| / 10",
            stats.UNTESTED,
            f"{med['m^c / sqrt(v^p)']:.3g} vs {med['m^c / sqrt(v^c)']:.3g}, {way(shrink)}; {ONE_RUN}",
        ),
        Claim.compared(
            "subtracting Phi moves the update back towards the clean one: median |m^c / sqrt(v^p - Phi)| > "
            "median |m^c / sqrt(v^p)|",
            stats.UNTESTED,
            f"{med['m^c / sqrt(v^p - Phi)']:.3g} vs {med['m^c / sqrt(v^p)']:.3g}, on the {kept:.1%} of coordinates "
            f"where v^p > Phi, {way(back)}; {ONE_RUN}",
        ),
    ]


register(
    Restatement(
        TABLE_ID,
        {},
        claims=claims_from_frame,
        notes=lambda old, claims: restated_rule_notes(old, claims, (), WHAT),
    )
)
