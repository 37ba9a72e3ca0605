"""Ganesh, McMahan & Thakurta Figs. 4-6: why bias correction struggles, from the Fig. 3 runs' diagnostics.

All three figures use the DP-SGD column at BandMF's RMSE (paper: sigma = 0.134, independent noise) of
``runs/ganesh_fig3_<profile>``; the numbers are *diagnostic* (computed from clean clipped gradients, logged under
``diag/``), never private outputs.

* Fig. 4: the fraction of coordinates of the bias-corrected second moment v^ - Phi_t that are negative, per
  round, in the bias-correction run (paper: 45-50 % in most rounds).
* Fig. 5: ||g_t|| / C for the averaged clipped gradient of the post-processing run (paper: about 0.27 on average,
  far above the "pessimistic" 1 / sqrt(B) of gradients that cancel).
* Fig. 6: the non-private Adam run's second moment v against the bias term C^2 sigma^2 / B^2 (paper: most
  coordinates fall below it, so after subtracting the bias the estimate is dominated by noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from dp_adam_bench.report import stats
from dp_adam_bench.report.aggregate import get
from dp_adam_bench.report.common import Claim, incomplete_note, load_paper, save_figure, write_table
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.expected import preset_runs
from dp_adam_bench.report.ganesh_cells import COLUMNS, column_of, profile_setting
from dp_adam_bench.report.restate import Markdown
from dp_adam_bench.report.restate_md import MdRestatement
from dp_adam_bench.report.restate_md import register as register_md
from dp_adam_bench.report.skeleton import SeedStats, restated_rule_notes, rule_notes, versus, within
from dp_adam_bench.sweep import load_preset

TABLE_ID = "ganesh_figs4_6"
STD = f"ours{stats.STD_SUFFIX}"
WHAT = "the diagnostics and the paper's bars"


def _runs(records, optimizer: str, private: bool, s: dict):
    out = []
    for r in records:
        if get(r.config, "optimizer.name") != optimizer or (get(r.config, "noise.kind") != "none") != private:
            continue
        if private and column_of(r.config, float(s["sigma_low"]), float(s["sigma_high"])) != COLUMNS[0]:
            continue
        out.append(r)
    return out


def _series(records, key: str) -> pd.DataFrame:
    """Mean and std over runs of a logged metric per step."""
    frames = [f for f in (_run_series(r, key) for r in records) if not f.empty]
    if not frames:
        return pd.DataFrame(columns=["mean", "std"])
    return pd.concat(frames).groupby("step")[key].agg(["mean", "std"])


def _run_series(r, key: str) -> pd.DataFrame:
    """One run's logged ``key`` per step."""
    return pd.DataFrame([{"step": m["step"], key: m[key]} for m in r.metrics() if m.get(key) is not None])


def _per_run(records, key: str, reduce) -> list[float]:
    """Each run's series of ``key`` reduced to one number (``reduce``: a pandas Series -> float); runs that logged
    none left out. The seeds are the repetitions the claims test over."""
    out = []
    for r in records:
        series = _run_series(r, key)
        if not series.empty:
            out.append(float(reduce(series.sort_values("step")[key])))
    return out


def _last_histogram(records, array: str) -> np.ndarray | None:
    for r in records:
        files = sorted((r.path / "diagnostics").glob("step_*.npz"), key=lambda p: int(p.stem.split("_")[1]))
        if files:
            with np.load(files[-1]) as z:
                if array in z:
                    return z[array]
    return None


@dataclass(frozen=True)
class Diagnostics:
    """The per-round series the three figures read (mean and std over runs, per logged round), the bias
    C^2 sigma^2 / B^2 and the last saved coordinate sample of the non-private v."""

    negative: pd.DataFrame  # Fig. 4: fraction of v^ - Phi < 0, bias-correction run
    norm: pd.DataFrame  # Fig. 5: ||g_t|| / C, post-processing run
    below: pd.DataFrame  # Fig. 6: fraction of the non-private v below the bias
    bias: float | None
    v_sample: np.ndarray | None
    below_note: str  # where ``below`` came from, when not from the logged series
    # per seed (run): Fig. 4's median over rounds, Fig. 5's average over rounds, Fig. 6's last round
    negative_runs: tuple[float, ...] = ()
    norm_runs: tuple[float, ...] = ()
    below_runs: tuple[float, ...] = ()


def diagnostics(complete, s: dict, profile: str) -> Diagnostics:
    """The diagnostics of the bias-correction, post-processing and non-private Adam runs of Fig. 3."""
    bc, post, nonpriv = (
        _runs(complete, "bc", True, s),
        _runs(complete, "adam", True, s),
        _runs(complete, "adam", False, s),
    )
    below = _series(nonpriv, "diag/frac_v_below_bias")
    bias = next(
        (m["diag/reference_bias"] for r in nonpriv for m in r.metrics() if "diag/reference_bias" in m), None
    )
    v_sample = _last_histogram(nonpriv, "v_private")
    below_note = ""
    below_runs = _per_run(nonpriv, "diag/frac_v_below_bias", lambda s: s.iloc[-1])
    if below.empty and v_sample is not None:
        # a non-private run records privacy.clip as null, so its diagnostics had no C for the bias: take the
        # preset's C and compute the fraction from the saved coordinate sample of v (the last logged round)
        clip = float(load_preset("ganesh_fig3", profile)["privacy"]["clip"])
        bias = (clip * float(s["sigma_low"]) / float(s["batch_size"])) ** 2
        below = pd.DataFrame({"mean": [float((v_sample < bias).mean())], "std": [0.0]})
        below_runs = [float(below["mean"].iloc[0])]  # one run's saved sample: one seed
        below_note = f"from the saved sample of {v_sample.size} coordinates of v at the last logged round"
    return Diagnostics(
        negative=_series(bc, "diag/frac_negative_after_bc"),
        norm=_series(post, "diag/grad_norm_over_clip"),
        below=below,
        bias=bias,
        v_sample=v_sample,
        below_note=below_note,
        negative_runs=tuple(_per_run(bc, "diag/frac_negative_after_bc", lambda s: s.median())),
        norm_runs=tuple(_per_run(post, "diag/grad_norm_over_clip", lambda s: s.mean())),
        below_runs=tuple(below_runs),
    )


def paper_beside_ours(d: Diagnostics, paper: dict, batch: float) -> pd.DataFrame:
    """One row per figure's quantity: the paper's reading beside ours (per seed, then the mean over seeds: the
    sample std and the seeds beside it), and the rounds it is over."""
    neg, norm, below = d.negative, d.norm, d.below
    lo, hi = paper["negative_fraction_range"]

    def cell(values) -> dict:
        c = SeedStats.of(values) if values else None
        return {"ours": c.mean if c else None, STD: c.std if c else None, "n": c.n if c else 0}

    rows = [
        {
            "figure": "fig4",
            "quantity": "fraction of v^ - Phi < 0 (bias correction), median over rounds",
            "paper": f"{lo:.2f}-{hi:.2f} in most rounds",
            **cell(d.negative_runs),
            "rounds": len(neg),
        },
        {
            "figure": "fig5",
            "quantity": "‖g_t‖ / C (post-processing), average over rounds",
            "paper": f"{paper['mean_grad_norm_over_clip']:.2f}",
            **cell(d.norm_runs),
            "rounds": len(norm),
        },
        {
            "figure": "fig5",
            "quantity": "1 / sqrt(B), the pessimistic regime",
            "paper": f"{1 / math.sqrt(PAPER_BATCH):.3f}",
            "ours": 1 / math.sqrt(batch),
            STD: None,
            "n": None,
            "rounds": None,
        },
        {
            "figure": "fig6",
            "quantity": "fraction of non-private v below C^2 sigma^2 / B^2, last round",
            "paper": "most coordinates",
            **cell(d.below_runs),
            "rounds": len(below),
        },
    ]
    df = pd.DataFrame(rows)
    df["rounds"] = df["rounds"].astype("Int64")
    df["n"] = df["n"].astype("Int64")
    return df


#: the paper's expected batch size (Fig. 5's 1 / sqrt(B) = 0.022)
PAPER_BATCH = 2048
#: Fig. 5's claim: "far from" the pessimistic 1 / sqrt(B) is read as more than this many times it
FAR = 2
#: the fig4 claim's text before it named what it tests (the median over rounds, per seed)
OLD_FIG4 = (
    "about half of the bias-corrected coordinates are negative ({lo:.0%}-{hi:.0%}, +-5 points) in most rounds"
)
FIG4 = (
    "about half of the bias-corrected coordinates are negative: the median over rounds of the fraction is in "
    "{lo:.0%}-{hi:.0%} (+-5 points)"
)
NO_SPREAD = "no test: this table kept the mean over seeds, not their spread (its builder now writes it)"


def _cell(row: dict) -> SeedStats | None:
    """A row's cell over seeds; None where the table kept no spread column (a table written before it did)."""
    if STD not in row:
        return None
    return SeedStats.from_row(row, std=STD) if row["n"] and not pd.isna(row["n"]) else None


def _compared(text: str, row: dict, g_of, detail: str) -> Claim:
    """A claim on one row's cell: in its state by ``g_of(cell)`` (a Gap positive in the paper's direction), or
    untested where the table kept no spread."""
    c = _cell(row)
    if c is None:
        return Claim.compared(text, stats.UNTESTED, f"{detail}; {NO_SPREAD}")
    g = g_of(c)
    parts = [detail, g.test(), *([g.flag()] if g.flag() else [])]
    return Claim.compared(text, stats.state(g), "; ".join(parts))


def claims_from_frame(frame: pd.DataFrame, band: tuple[float, float]) -> list[Claim]:
    """One claim per figure whose quantity the table has, on its own rows (its CSV holds what they read)."""
    lo, hi = band
    rows = {(r["figure"], r["quantity"].split(" ")[0]): r for r in frame.to_dict("records")}
    claims = []
    neg = rows.get(("fig4", "fraction"))
    if neg is not None and not pd.isna(neg["ours"]):
        claims.append(
            _compared(
                FIG4.format(lo=lo, hi=hi),
                neg,
                lambda c: within(c, lo - 0.05, hi + 0.05),
                f"median over {neg['rounds']} logged rounds {neg['ours']:.3f} (mean over seeds)",
            )
        )
    norm, root = rows.get(("fig5", "‖g_t‖")), rows.get(("fig5", "1"))
    if norm is not None and not pd.isna(norm["ours"]) and root is not None:
        batch = 1 / float(root["ours"]) ** 2
        far = FAR / math.sqrt(batch)
        claims.append(
            _compared(
                f"the averaged clipped gradient is far from the pessimistic regime: ||g|| / C > {FAR} / sqrt(B)",
                norm,
                lambda c: versus(c, far, above=True),
                f"average {norm['ours']:.3f} vs {FAR} / sqrt(B) = {far:.3f} (1 / sqrt(B) = {1 / math.sqrt(batch):.3f}, "
                f"B = {batch:g}; paper: 0.27 vs {FAR} / sqrt({PAPER_BATCH}) = {FAR / math.sqrt(PAPER_BATCH):.3f})",
            )
        )
    below = rows.get(("fig6", "fraction"))
    if below is not None and not pd.isna(below["ours"]):
        claims.append(
            _compared(
                "most coordinates of the non-private second moment fall below the bias C^2 sigma^2 / B^2",
                below,
                lambda c: versus(c, 0.5, above=True),
                f"{below['ours']:.1%} of the coordinates below it at the last logged round (mean over seeds)",
            )
        )
    return claims


def _notes(runs, s: dict, profile: str) -> list[str]:
    notes = [
        "Diagnostic quantities: computed from clean (un-noised) clipped gradients and logged under diag/; "
        "they are not private outputs.",
        f"Runs: the '{COLUMNS[0]}' column of {runs.spec.name} (sigma = {s['sigma_low']:g}, B = {s['batch_size']}); "
        "see results/ganesh_fig3.md for the setting and how it differs from the paper.",
    ]
    if profile == "cpu":
        notes.append(
            f"CPU profile: a pretrained MiniLM-L6 (with an MLM head fitted non-privately) fine-tuned for "
            f"{s['epochs']} epochs of {s['train_subset']} abstracts at B = {s['batch_size']}, not TinyBERT "
            "fine-tuned for 2,000 steps of 2,048: the gradient statistics of a short fine-tuning of a larger "
            "model may differ from the paper's."
        )
    return notes + incomplete_note(runs.incomplete)


def build(ctx: ReportContext | None = None) -> list[Path]:
    """Write ``<ctx.out>/ganesh_figs4_6.{csv,md,png}`` from the runs of ganesh_fig3 (Figs. 4-6's diagnostics)."""
    ctx = ctx or ReportContext()
    profile = ctx.profile
    paper = load_paper("ganesh")["figs4_6"]
    runs = preset_runs(ctx, "ganesh_fig3")
    if not runs.complete:
        raise FileNotFoundError(
            f"no complete runs in {ctx.where(runs.spec.name)}; run `make reproduce-table TABLE=ganesh_fig3 "
            f"PROFILE={profile}` first"
        )
    s = profile_setting(profile)
    batch = float(s["batch_size"])
    d = diagnostics(runs.complete, s, profile)
    band = tuple(paper["negative_fraction_range"])
    df = paper_beside_ours(d, paper, batch)
    claims = claims_from_frame(df, band)
    fig = _figure(d.negative, d.norm, d.v_sample, d.bias, batch, band, ctx.out)
    return write_table(
        TABLE_ID,
        df,
        out=ctx.out,
        title="Ganesh et al. Figs. 4-6 — second-moment diagnostics (DP-SGD noise at BandMF's RMSE)",
        command=f"make reproduce-table TABLE={TABLE_ID} PROFILE={profile}",
        setting=f"profile {profile}, from the runs of ganesh_fig3 (bias correction, post-processing, non-private "
        "Adam).",
        claims=claims,
        notes=[*rule_notes(claims, WHAT), *_notes(runs, s, profile)],
        figure=fig,
        extra_sections=[
            (
                "Scale-then-privatize and the second moments of IME / BC, every column (mean over the logged "
                "rounds and seeds; diagnostic)",
                variant_section(runs.complete, s),
            )
        ],
        digits=3,
        missing=runs.lacking(optimizer="adam") + runs.lacking(optimizer="bc"),  # the runs these figures read
    )


#: (row optimizer, diag key, label) of the per-column section: what STP's clip acts on, and negative v for IME / BC
VARIANT_DIAGNOSTICS = (
    ("stp", "diag/frac_clipped", "STP: fraction of scaled per-example gradients clipped"),
    ("stp", "diag/norm_over_clip_median", "STP: median scaled per-example norm / C"),
    ("stp", "diag/stp_frac_sqrtv_above_eps_s1", "STP: fraction of coordinates with sqrt(v^) > eps_s1"),
    ("stp", "diag/stp_scale_min", "STP: smallest scale s (1 / eps_s1 at most)"),
    ("adam", "diag/frac_clipped", "post-processing: fraction of per-example gradients clipped"),
    ("bc", "diag/frac_negative_after_bc", "BC: fraction of v^ - Phi < 0"),
    ("ime", "diag/frac_v_negative", "IME: fraction of v^ < 0"),
)


def variant_section(records, s: dict) -> str:
    """The per-column means of :data:`VARIANT_DIAGNOSTICS`, with each STP run's setting and sigma C / B, the noise
    per coordinate of the scaled gradient (Ganesh §4.3.1's steady state needs it below 1)."""
    low, high = float(s["sigma_low"]), float(s["sigma_high"])
    lines = ["| quantity | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for opt, key, label in VARIANT_DIAGNOSTICS:
        cells = []
        for col in COLUMNS:
            runs = [
                r
                for r in records
                if get(r.config, "optimizer.name") == opt
                and get(r.config, "noise.kind") != "none"
                and column_of(r.config, low, high) == col
            ]
            series = _series(runs, key)
            cells.append(f"{series['mean'].mean():.4g}" if len(series) else "")
        if any(cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    settings = []
    for col in COLUMNS:
        for r in records:  # the setting of the first STP run of the column that logged its diagnostics
            logged = any("diag/stp_frac_sqrtv_above_eps_s1" in m for m in r.metrics())
            if get(r.config, "optimizer.name") == "stp" and column_of(r.config, low, high) == col and logged:
                sigma, clip = float(get(r.config, "privacy.sigma")), float(get(r.config, "privacy.clip"))
                eps_s1 = get(r.config, "optimizer.eps_s1")
                settings.append(
                    f"{col}: eps_s1 = {'the default' if eps_s1 is None else f'{eps_s1:g}'}, C = {clip:g}, "
                    f"sigma C / B = {sigma * clip / float(s['batch_size']):.3g}"
                )
                break
    return "\n".join(lines) + ("\n\nSTP settings: " + "; ".join(settings) + "." if settings else "")


def _figure(neg, norm, v_hist, bias, batch, band, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    if len(neg):
        axes[0].plot(neg.index, neg["mean"], marker="o")
        axes[0].axhspan(*band, color="gray", alpha=0.2, label="paper range")
        axes[0].legend(fontsize=8)
    axes[0].set(xlabel="round", ylabel="fraction negative", title="Fig. 4: v^ - Phi < 0 (bias correction)")
    if len(norm):
        axes[1].plot(norm.index, norm["mean"], marker="o", label="||g|| / C")
        axes[1].axhline(1 / math.sqrt(batch), color="gray", ls=":", label="1 / sqrt(B)")
        axes[1].axhline(FAR / math.sqrt(batch), color="k", ls=":", label=f"{FAR} / sqrt(B), the claim's bar")
        axes[1].legend(fontsize=8)
    axes[1].set(
        xlabel="round", ylabel="||g|| / C", title="Fig. 5: averaged clipped gradient (post-processing)"
    )
    if v_hist is not None:
        v = v_hist[v_hist > 0]
        axes[2].hist(np.log10(v), bins=60, color="C2")
        if bias is not None:
            axes[2].axvline(math.log10(bias), color="k", ls="--", label="C^2 sigma^2 / B^2")
            axes[2].legend(fontsize=8)
    axes[2].set(
        xlabel="log10 v (non-private Adam)", ylabel="coordinates (sample)", title="Fig. 6: v vs the bias"
    )
    fig.tight_layout()
    return save_figure(fig, TABLE_ID, out)


def _restated_claims(frame: pd.DataFrame, md: Markdown, results: Path) -> list[Claim]:
    del md, results
    return claims_from_frame(frame, tuple(load_paper("ganesh")["figs4_6"]["negative_fraction_range"]))


def _retext(text: str) -> str:
    lo, hi = load_paper("ganesh")["figs4_6"]["negative_fraction_range"]
    return FIG4.format(lo=lo, hi=hi) if text == OLD_FIG4.format(lo=lo, hi=hi) else text


register_md(
    MdRestatement(
        TABLE_ID,
        {},
        _restated_claims,
        lambda old, claims, md: restated_rule_notes(old, claims, (), WHAT),
        lambda frame, md, results: md.sections,
        _retext,
        digits=3,
        text=("rounds", "n"),
    )
)
