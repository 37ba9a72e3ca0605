"""Li, Tramer, Liang & Hashimoto (ICLR 2022, arXiv:2110.05679), Methodology, "Batch Size, Learning Rate": E2E BLEU
at eps = 3 over a grid of batch sizes B and learning rates at a fixed number of epochs, the effective noise
multiplier, and the gradient signal-to-noise ratio against B.

Reads ``runs/li_hyperparams_<profile>`` (preset ``configs/experiment/li_hyperparams.yaml``). What it computes, per
run (one seed a cell unless the preset says otherwise):

* BLEU and ROUGE-L of each (B, lr) cell: the heatmap (``li_hyperparams.png``, left);
* sigma (calibrated to eps = 3 over the run's steps) and sigma_eff = sigma / q = sigma N / B (sigma and q as the
  run's privacy ledger records them), the multiplier of the
  noise in the averaged update (the noise of the mean gradient is sigma C / B; at q = B / N it is sigma_eff C / N):
  Li et al.'s argument that a larger batch at a fixed epsilon and number of epochs lowers the noise;
* the gradient-SNR r = ||g|| / ||z||, with ||g|| the averaged clipped gradient's norm (``diag/grad_norm_over_clip``
  times C, logged by the runs' diagnostics: computed from clean gradients, a DIAGNOSTIC, never released) and
  ||z|| = sigma C sqrt(d) / B the norm of the noise added to it (d: the trainable count), the median over the run's
  logged steps (middle panel);
* the square-root rule: at a fixed epsilon and number of epochs the CLT approximation of the accountant,
  mu = q sqrt(T (e^{1/sigma^2} - 1)) ~ q sqrt(T) / sigma = sqrt(B E / N) / sigma, makes sigma grow as sqrt(B).
  ``sigma_sqrt_rule`` is that rule's prediction anchored at the largest batch of the grid,
  sigma(B_max) sqrt(B / B_max), beside the sigma each run was calibrated to; the right panel draws both over a
  dense range of B, calibrated here under RDP for the runs' N, epochs, delta and epsilon (exact accounting, no
  training). The approximation e^{1/sigma^2} - 1 ~ 1 / sigma^2 fails where sigma is small, i.e. at small B.

Claims: the best BLEU over learning rates grows with B; sigma_eff falls as B grows; the gradient-SNR grows with B;
the square-root rule underestimates sigma at the smallest B (Li et al.'s slide: "square-root relationship
underestimates the noise multiplier for small batch sizes"). The first is checked between neighbouring batch sizes
by Welch's t over seeds; the others are deterministic functions of the accounting (sigma_eff, the square-root rule)
or a per-run diagnostic (the SNR's median), read as they are.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from dp_adam_bench.report import stats
from dp_adam_bench.report.aggregate import get
from dp_adam_bench.report.common import Claim, incomplete_note, save_figure
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.restate import Restatement, register
from dp_adam_bench.report.skeleton import (
    Ordering,
    SeedStats,
    Table,
    complete_runs,
    ordering_claims,
    restated_rule_notes,
    rule_notes,
)

TABLE_ID = "li_hyperparams"
TITLE = "Li et al. — batch size and learning rate at eps = 3 (E2E): BLEU heatmap, sigma_eff, gradient-SNR"
SNR_KEY = "diag/grad_norm_over_clip"


def build(ctx: ReportContext | None = None) -> list[Path]:
    ctx = ctx or ReportContext()
    command = f"make reproduce-table TABLE={TABLE_ID} PROFILE={ctx.profile}"
    found = complete_runs(ctx, TABLE_ID, command)
    frame = pd.DataFrame([run_row(r) for r in found.complete])
    frame = (
        frame.groupby(["batch_size", "lr"], as_index=False)
        .agg(
            bleu=("bleu", "mean"),
            bleu_sample_std=("bleu", lambda s: float(s.std(ddof=1)) if len(s) > 1 else float("nan")),
            rouge_l=("rouge_l", "mean"),
            sigma=("sigma", "mean"),
            sigma_eff=("sigma_eff", "mean"),
            gradient_snr=("gradient_snr", "mean"),
            steps=("steps", "first"),
            n=("bleu", "size"),
        )
        .sort_values(["batch_size", "lr"])
    )
    frame["sigma_sqrt_rule"] = sqrt_rule(frame)
    frame = frame.astype({"batch_size": "Int64", "steps": "Int64", "n": "Int64"})
    curve = sqrt_rule_curve(found.complete)
    claims = claims_from_frame(frame)
    figure = _figure(frame, curve, ctx.out)
    return Table(
        TABLE_ID,
        TITLE,
        command,
        frame,
        setting=_setting(found.complete, ctx.profile),
        claims=claims,
        notes=_notes(frame, claims, found, ctx.profile),
        figure=figure,
        digits=4,
        missing=found.missing,
        extra_sections=[(_CURVE_TITLE, _curve_section(curve))] if curve is not None else [],
    ).write(ctx.out)


def run_row(r) -> dict:
    """One run: its cell, scores, sigma, sigma_eff and median gradient-SNR over the logged diagnostic steps."""
    cfg, s = r.config, r.summary
    b = float(get(cfg, "train.batch_size"))
    sigma, q = accounted(s)
    clip = float(get(cfg, "privacy.clip"))
    d = (s.get("finetune") or {}).get("trainable_params")
    snr = gradient_snr([m[SNR_KEY] for m in r.metrics() if SNR_KEY in m], clip, sigma, b, d)
    return {
        "batch_size": int(b),
        "lr": float(get(cfg, "optimizer.lr")),
        "bleu": float(s["metrics"].get("test_bleu", float("nan"))),
        "rouge_l": float(s["metrics"].get("test_rougeL", float("nan"))),
        "sigma": sigma,
        "sigma_eff": sigma / q,
        "gradient_snr": snr,
        "steps": int(s.get("steps", 0)),
    }


def accounted(summary: dict) -> tuple[float, float]:
    """(sigma, q) of the run's Poisson steps as its privacy ledger records them (what the accountant used)."""
    events = [
        e for e in (summary.get("ledger") or {}).get("events", []) if e.get("kind") == "poisson_gaussian"
    ]
    if len({(e["sigma"], e["q"]) for e in events}) != 1:
        return float("nan"), float("nan")
    return float(events[0]["sigma"]), float(events[0]["q"])


def gradient_snr(norms_over_clip, clip: float, sigma: float, batch: float, d) -> float:
    """Median over steps of ||g|| / ||z||: ||g|| = (logged ||g|| / C) C, ||z|| = sigma C sqrt(d) / B (NaN without
    logged norms, sigma or d)."""
    if not norms_over_clip or not d or not sigma or not math.isfinite(sigma):
        return float("nan")
    noise = noise_over_clip(sigma, d, batch)
    return float(np.median([float(x) / noise for x in norms_over_clip]))


def noise_over_clip(sigma: float, d: int, batch: float) -> float:
    """||z|| / C = sigma sqrt(d) / B: the norm of the Gaussian noise in the averaged update (sigma C per coordinate
    of the sum, d trainable coordinates, divided by the expected batch B) over the clipping norm C."""
    return float(sigma) * math.sqrt(float(d)) / float(batch)


def sqrt_rule(frame: pd.DataFrame) -> pd.Series:
    """Per row, the square-root rule's sigma for its batch size anchored at the grid's largest batch:
    sigma(B_max) sqrt(B / B_max), sigma(B_max) the mean calibrated sigma of the largest batch's runs."""
    per_b = frame.groupby("batch_size")["sigma"].mean()
    b_max = per_b.index.max()
    return per_b[b_max] * np.sqrt(frame["batch_size"] / b_max)


def sqrt_rule_curve(complete) -> pd.DataFrame | None:
    """sigma calibrated under RDP against the square-root rule over batch sizes from B_min / 8 to B_max, for the
    runs' N = B / q, epochs = steps q, delta and epsilon (exact accounting, no training); None if the runs do not
    share them."""
    from dp_adam_bench.privacy.accounting.calibration import calibrate_sigma

    setups, batches = set(), set()
    for r in complete:
        sigma, q = accounted(r.summary)
        b = int(get(r.config, "train.batch_size"))
        steps = int(r.summary.get("steps", 0))
        eps, delta = get(r.config, "privacy.target_epsilon"), get(r.config, "privacy.delta")
        if not (math.isfinite(q) and q > 0 and steps > 0 and eps and delta):
            return None
        setups.add((round(b / q), round(steps * q, 6), float(eps), float(delta)))
        batches.add(b)
    if len(setups) != 1:
        return None
    n, epochs, eps, delta = setups.pop()
    b_max = max(batches)
    grid = sorted(
        {int(2**k) for k in range(max(0, int(math.log2(min(batches))) - 3), int(math.log2(b_max)) + 1)}
    )
    grid = [b for b in sorted(set(grid) | batches) if b <= b_max and b / n < 1]
    rows = []
    for b in grid:
        steps = max(1, round(epochs * n / b))
        rows.append(
            {"batch_size": b, "steps": steps, "sigma": calibrate_sigma(eps, delta, b / n, steps, "rdp")}
        )
    curve = pd.DataFrame(rows)
    top = float(curve.loc[curve["batch_size"] == b_max, "sigma"].iloc[0])
    curve["sigma_sqrt_rule"] = top * np.sqrt(curve["batch_size"] / b_max)
    curve["ratio"] = curve["sigma"] / curve["sigma_sqrt_rule"]
    curve.attrs.update(n=n, epochs=epochs, eps=eps, delta=delta)
    return curve


_CURVE_TITLE = "The square-root rule against calibrated sigma (exact accounting, no training)"


def _curve_section(curve: pd.DataFrame) -> str:
    a = curve.attrs
    lines = [
        f"N = {a['n']}, {a['epochs']:g} epoch(s), eps = {a['eps']:g}, delta = {a['delta']:g}, RDP calibration "
        "(the runs' own). sqrt rule: sigma(B_max) sqrt(B / B_max).",
        "",
        "| B | steps | sigma (calibrated) | sigma (sqrt rule) | calibrated / sqrt rule |",
        "|---|---|---|---|---|",
    ]
    for row in curve.itertuples():
        lines.append(
            f"| {row.batch_size} | {row.steps} | {row.sigma:.4f} | {row.sigma_sqrt_rule:.4f} | {row.ratio:.2f} |"
        )
    return "\n".join(lines)


def claims_from_frame(frame: pd.DataFrame) -> list[Claim]:
    """The claims on the table's cells (its CSV holds everything they read)."""
    per_b = frame.groupby("batch_size").agg(sigma_eff=("sigma_eff", "mean"), snr=("gradient_snr", "median"))
    out = best_bleu_claims(frame)
    if len(per_b) > 1:
        falling = bool(np.all(np.diff(per_b["sigma_eff"].to_numpy()) < 0))
        detail = ", ".join(f"B = {b}: {v:.1f}" for b, v in per_b["sigma_eff"].items())
        out.append(
            Claim.exact("sigma_eff = sigma N / B falls as the batch size grows", falling, detail, SIGMA_EXACT)
        )
        snr = per_b["snr"].to_numpy()
        if np.isfinite(snr).all():
            detail = ", ".join(f"B = {b}: {v:.3g}" for b, v in per_b["snr"].items())
            way = "the paper's direction" if np.all(np.diff(snr) > 0) else "not the paper's direction"
            out.append(
                Claim.compared(
                    "the gradient-SNR grows with the batch size (diagnostic)",
                    stats.UNTESTED,
                    f"{detail}, {way}; {SNR_UNTESTED}",
                )
            )
        sigma = frame.groupby("batch_size")[["sigma", "sigma_sqrt_rule"]].mean().sort_index()
        if "sigma_sqrt_rule" in frame and np.isfinite(sigma.to_numpy()).all():
            b_min = sigma.index.min()
            cal, rule = sigma.loc[b_min, "sigma"], sigma.loc[b_min, "sigma_sqrt_rule"]
            detail = (
                f"B = {b_min}: calibrated sigma {cal:.3f} against {rule:.3f} from sigma(B = {sigma.index.max()}) "
                f"sqrt(B / B_max), {cal / rule:.2f}x"
            )
            out.append(
                Claim.exact(
                    "the square-root rule (sigma ~ sqrt(B) at a fixed eps and epochs) underestimates the noise "
                    "multiplier at the smallest batch size",
                    bool(cal > rule),
                    detail,
                    SIGMA_EXACT,
                )
            )
    return out


def best_bleu_claims(frame: pd.DataFrame) -> list[Claim]:
    """Li et al.'s "large batches do better at a fixed eps and epochs", between each pair of neighbouring batch
    sizes: the cell with the best mean BLEU over learning rates at the larger B against the one at the smaller, by
    Welch's t over their seeds (:mod:`dp_adam_bench.report.skeleton`)."""
    rows = frame[frame["bleu"].notna()]
    if rows.empty:
        return []
    best = rows.loc[rows.groupby("batch_size")["bleu"].idxmax()].sort_values("batch_size")
    cells, lr = {}, {}
    for r in best.itertuples():
        std = float(r.bleu_sample_std)
        cells[int(r.batch_size)] = SeedStats(float(r.bleu), std if math.isfinite(std) else None, int(r.n))
        lr[int(r.batch_size)] = float(r.lr)
    sizes = sorted(cells)
    orderings = [
        Ordering(
            big,
            small,
            f"the best BLEU over learning rates is higher at B = {big} (lr {lr[big]:g}) than at B = {small} "
            f"(lr {lr[small]:g})",
            paper="larger batches do better at a fixed eps and number of epochs",
        )
        for small, big in zip(sizes, sizes[1:], strict=False)
    ]
    return ordering_claims([replace(o, not_independent=SAME_SEEDS) for o in orderings], cells, unit="BLEU")


#: why the best-BLEU comparisons are no independent test
SAME_SEEDS = (
    "each batch size's best learning rate is picked on the very seeds the test reads (as the paper's heatmap "
    "reads), so each best cell's mean is biased upward and p is not an independent test; seeds outside the choice "
    "(or a dev split) would decide it"
)
#: why the sigma claims are exact
SIGMA_EXACT = (
    "sigma is calibrated by the RDP accountant, a deterministic function of N, B, epochs, eps and delta (no test "
    "over seeds); a strict inequality, the calibration's tolerance far below the gaps printed"
)
#: why the SNR claim is untested
SNR_UNTESTED = (
    "no test: the table keeps each cell's mean gradient-SNR over seeds (the median over its learning rates per "
    "batch size), not its spread"
)


def _figure(frame: pd.DataFrame, curve: pd.DataFrame | None, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = frame.pivot(index="batch_size", columns="lr", values="bleu").sort_index(ascending=False)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    im = axes[0].imshow(grid.to_numpy(), cmap="viridis", aspect="auto")
    axes[0].set_xticks(range(len(grid.columns)), [f"{c:g}" for c in grid.columns])
    axes[0].set_yticks(range(len(grid.index)), [str(i) for i in grid.index])
    for (i, j), v in np.ndenumerate(grid.to_numpy()):
        if np.isfinite(v):
            axes[0].text(j, i, f"{v:.1f}", ha="center", va="center", color="w", fontsize=9)
    axes[0].set(xlabel="learning rate", ylabel="batch size", title="BLEU at eps = 3 (fixed epochs)")
    fig.colorbar(im, ax=axes[0])
    per_b = frame.groupby("batch_size")["gradient_snr"].median()
    axes[1].plot(per_b.index, per_b.to_numpy(), marker="o")
    axes[1].set(
        xscale="log", xlabel="batch size", ylabel="||g|| / ||z||", title="(a) Gradient-SNR (diagnostic)"
    )
    if curve is not None:
        axes[2].plot(curve["batch_size"], curve["sigma"], marker="o", label="calibrated (RDP)")
        axes[2].plot(curve["batch_size"], curve["sigma_sqrt_rule"], ls="--", label="sqrt rule from B_max")
        axes[2].legend()
    axes[2].set(xscale="log", xlabel="batch size", ylabel="sigma", title="sigma at a fixed eps and epochs")
    fig.tight_layout()
    return save_figure(fig, TABLE_ID, out)


def _setting(complete, profile: str) -> str:
    cfg, s = complete[0].config, complete[0].summary
    return (
        f"profile {profile}: {s.get('data_note', '')}; eps = {get(cfg, 'privacy.target_epsilon')} (RDP, delta = "
        f"{get(cfg, 'privacy.delta')}), C = {get(cfg, 'privacy.clip')}, Adam, Poisson sampling, the same number of "
        "epochs at every batch size, full fine-tuning, bk clipping."
    )


def best_lr_note(frame: pd.DataFrame) -> list[str]:
    """Which learning rate scored best at each batch size, and whether it sits at the grid's edge: the linear
    scaling rule (lr proportional to B) asks a larger batch for a larger lr, and a best lr at the largest value
    tried means that batch size's best BLEU is a lower bound."""
    lrs = sorted(frame["lr"].unique())
    if len(lrs) < 2:
        return []
    parts, edge = [], []
    for b, cell in frame.groupby("batch_size"):
        if cell["bleu"].notna().any():
            best = float(cell.loc[cell["bleu"].idxmax(), "lr"])
            parts.append(f"B = {b}: {best:g}")
            if best == lrs[-1]:
                edge.append(str(b))
    note = f"Best learning rate per batch size: {', '.join(parts)} (grid {', '.join(f'{x:g}' for x in lrs)})."
    if edge:
        note += (
            f" At B = {', '.join(edge)} the best is the largest lr tried, so that batch size's best BLEU is a lower "
            "bound: the linear scaling rule (Li et al.) would scale the lr with B, beyond this grid, and the "
            "ordering of the best BLEU over batch sizes is not settled by it."
        )
    return [note]


def steps_note(frame: pd.DataFrame, claims: list[Claim]) -> list[str]:
    """Where a larger batch's best BLEU is not higher: the step counts a fixed number of epochs leaves each batch
    size (from the table's ``steps`` column), against which the claim is read."""
    if not any(c.state in (stats.DISAGREES, stats.CONTRADICTED) for c in _best_claims(claims)):
        return []
    steps = frame.groupby("batch_size")["steps"].first().sort_index()
    parts = ", ".join(f"B = {b}: {int(t)}" for b, t in steps.items())
    return [
        f"At a fixed number of epochs a larger batch takes fewer steps (Adam steps per run: {parts}). Where the "
        "best BLEU falls with B here, the larger batches stop after a few steps on the same learning-rate grid, "
        "while their noise is the smallest (sigma_eff and the gradient-SNR above): the step count binds before "
        "the noise does. Li et al.'s claim is for runs long enough that it does not (the paper profile: 10 "
        "epochs of all 42,061 pairs)."
    ]


#: the note on choosing the learning rate on the seeds it is scored on (its first words the same before the rule)
PICK_NOTE = (
    "The best learning rate at each batch size is picked on the same seeds it is scored on (as the paper's heatmap "
    "reads): each best cell's mean is biased upward, and Welch's t does not correct for the choice, so the "
    "best-BLEU comparisons are at most agreed or disagreed with, never decided, until seeds outside the choice are "
    "run."
)
PICK_OPENING = "The best learning rate at each batch size is picked"
WHAT = "the batch sizes"


def _best_claims(claims: list[Claim]) -> list[Claim]:
    return [c for c in claims if c.text.startswith("the best BLEU")]


def _notes(frame: pd.DataFrame, claims: list[Claim], found, profile: str) -> list[str]:
    notes = rule_notes(_best_claims(claims), WHAT)
    notes += steps_note(frame, claims) + best_lr_note(frame)
    notes.append(PICK_NOTE)
    notes.append(
        "The gradient-SNR is a diagnostic: its numerator is the norm of the clean averaged clipped gradient "
        "(diag/grad_norm_over_clip), a statistic of the private batch that the mechanism does not release."
    )
    if profile == "cpu":
        notes.append(
            "CPU profile: the 4-layer GPT-2 li_e2e pretrains on arXiv abstracts, one epoch of a 16,384-pair subset, "
            "a 3 x 3 grid: compare the trends, not the scores (configs/experiment/li_hyperparams.yaml)."
        )
    return notes + incomplete_note(found.incomplete)


register(
    Restatement(
        TABLE_ID,
        {},
        claims=claims_from_frame,
        notes=lambda old, claims: restated_rule_notes(
            [PICK_NOTE if n.startswith(PICK_OPENING) else n for n in old], _best_claims(claims), (), WHAT
        ),
    )
)
