"""Tang & Lecuyer Fig. 3: ablations of DP-AdamBC and DP-Adam-Biased (CIFAR-10 or SNLI).

``build(ctx, dataset)`` reads ``runs/tang_fig3_<dataset>_<profile>`` and sorts each run into the ablation it belongs to:

* ``phi``: DP-AdamBC subtracting Phi' instead of the true Phi = (sigma C / B)^2 (``optimizer.phi`` or
  ``optimizer.phi_scale``), at the dataset's gamma';
* ``gamma_bc``: DP-AdamBC's gamma' (the floor under v^ - Phi), subtracting the true Phi;
* ``gamma_biased``: DP-Adam-Biased's gamma (its eps), at the default betas;
* ``beta``: DP-Adam-Biased with (1 - beta1) = sqrt(1 - beta2), at the default gamma.

Each point is the final test accuracy (mean and sample std over seeds). The claims are the paper's reading of its
Fig. 3, each ordering judged by the shared rule (:mod:`dp_adam_bench.report.stats`: Welch's t-test).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pandas as pd

from dp_adam_bench.report.aggregate import get
from dp_adam_bench.report.common import Claim, incomplete_note, load_paper, save_figure
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.restate import Restatement, register
from dp_adam_bench.report.skeleton import (
    Ordering,
    SeedStats,
    Table,
    complete_runs,
    ordering_claim,
    restated_rule_notes,
    rule_notes,
)
from dp_adam_bench.report.stats import STD_SUFFIX, UNTESTED, Gap

STD = f"test_accuracy{STD_SUFFIX}"
#: what the orderings compare, in the note saying when the seeds decide none of them
WHAT = "the ablation points"
CHANCE = {"snli": 100 / 3, "cifar10": 10.0}  # accuracy of a constant prediction, %
ABLATIONS = {
    "phi": "DP-AdamBC: Phi' subtracted",
    "gamma_bc": "DP-AdamBC: gamma'",
    "gamma_biased": "DP-Adam-Biased: gamma",
    "beta": "DP-Adam-Biased: beta2, with 1 - beta1 = sqrt(1 - beta2)",
}


def _close(a, b) -> bool:
    return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-6)


def classify(cfg: dict, gamma_bc: float, gamma_biased: float) -> list[tuple[str, float]]:
    """The (ablation, x) points a run is part of (a default run can be a point of several)."""
    opt = get(cfg, "optimizer.name")
    phi_true = (
        float(get(cfg, "privacy.sigma"))
        * float(get(cfg, "privacy.clip"))
        / float(get(cfg, "train.batch_size"))
    ) ** 2
    out = []
    if opt == "adambc":
        phi, scale = get(cfg, "optimizer.phi"), float(get(cfg, "optimizer.phi_scale") or 1.0)
        effective = float(phi) if phi is not None else scale * phi_true
        true_phi = phi is None and scale == 1.0
        if _close(get(cfg, "optimizer.gamma"), gamma_bc):
            out.append(("phi", effective))
        if true_phi:
            out.append(("gamma_bc", float(get(cfg, "optimizer.gamma"))))
    elif opt == "adam":
        b1, b2 = float(get(cfg, "optimizer.beta1")), float(get(cfg, "optimizer.beta2"))
        if _close(b1, 0.9) and _close(b2, 0.999):
            out.append(("gamma_biased", float(get(cfg, "optimizer.eps"))))
        if _close(get(cfg, "optimizer.eps"), gamma_biased) and math.isclose(
            1 - b1, math.sqrt(1 - b2), rel_tol=2e-3
        ):
            out.append(("beta", b2))
    return out


def build(ctx: ReportContext, dataset: str) -> list[Path]:
    """The ablations of ``dataset`` (cifar10 or snli) from the runs of preset ``tang_fig3_<dataset>``."""
    if dataset not in CHANCE:
        raise ValueError(f"dataset {dataset!r} is not one of: {', '.join(CHANCE)}")
    paper = load_paper("tang")["settings"][dataset]
    table_id = f"tang_fig3_{dataset}"
    command = f"make reproduce-table TABLE={table_id} PROFILE={ctx.profile}"
    found = complete_runs(ctx, table_id, command)
    frame = _frame(found.complete, paper)
    cfg = found.complete[0].config
    phi_true = true_phi(cfg["privacy"]["sigma"], cfg["privacy"]["clip"], cfg["train"]["batch_size"])
    claims = claims_from_frame(frame, phi_true)
    return Table(
        table_id,
        f"Tang & Lecuyer Fig. 3 — ablations on {dataset}: final test accuracy (%)",
        command,
        frame,
        setting=_setting(found.complete, phi_true, ctx.profile),
        claims=claims,
        notes=notes_for(claims, frame, found, dataset, ctx.profile),
        figure=_figure(frame, table_id, phi_true, ctx.out),
        digits=3,
        missing=found.missing,
    ).write(ctx.out)


def _setting(complete, phi_true: float, profile: str) -> str:
    cfg = complete[0].config
    return (
        f"profile {profile}: C = {cfg['privacy']['clip']}, sigma = {cfg['privacy']['sigma']}, expected "
        f"B = {cfg['train']['batch_size']}, {complete[0].summary.get('steps')} steps; true Phi = {phi_true:.4g}."
    )


def true_phi(sigma, clip, batch_size) -> float:
    """The noise bias Phi = (sigma C / B)^2 of DP-Adam's second moment (Tang & Lecuyer, arXiv:2312.14334)."""
    return (float(sigma) * float(clip) / float(batch_size)) ** 2


def _frame(complete, paper: dict) -> pd.DataFrame:
    """One row per (ablation, x): the final test accuracy's mean, sample std and seeds."""
    points: dict[tuple[str, float], list[float]] = {}
    for r in complete:
        for ab, x in classify(r.config, paper["gamma"]["adambc"], paper["gamma"]["adam"]):
            points.setdefault((ab, x), []).append(float(r.summary["metrics"]["test_accuracy"]))
    rows = []
    for (ab, x), v in sorted(points.items()):
        cell = SeedStats.of(v)
        rows.append({"ablation": ab, "x": x, "test_accuracy": cell.mean, STD: cell.std, "n": cell.n})
    return pd.DataFrame(rows)


def _seeds_per_point(counts) -> str:
    """The seeds behind the table's points (their ``n``): ``One seed``, ``3 seeds`` or ``1-3 seeds``."""
    if not len(counts):
        return "No seed"
    low, high = int(min(counts)), int(max(counts))
    if low == high:
        return "One seed" if low == 1 else f"{low} seeds"
    return f"{low}-{high} seeds"


def claims_from_frame(frame: pd.DataFrame, phi_true: float) -> list[Claim]:
    """The paper's reading of its Fig. 3 on the table's own points (its CSV holds everything they read), each
    ordering with its Welch test and, where the seeds do not decide it, the flag."""
    cells = {
        (row["ablation"], row["x"]): SeedStats.from_row(row, mean="test_accuracy", std=STD)
        for row in frame.to_dict("records")
    }
    points = {ab: {x: c for (a, x), c in cells.items() if a == ab} for ab in ABLATIONS}
    phi = points["phi"]
    true = next((c for x, c in phi.items() if math.isclose(x, phi_true, rel_tol=1e-3)), None)
    claims = []
    if true is not None and len(phi) > 1:
        claims += _phi_claims(true, phi, phi_true)
    claims += _beta_claim(points["beta"])
    claims += _spread_claim(points["gamma_bc"], points["gamma_biased"])
    # the paper's last two readings: neither tuning gamma nor a longer moving average in DP-Adam-Biased gets what
    # subtracting the true Phi gets
    for ab, what in (("gamma_biased", "its gamma"), ("beta", "its betas")):
        if true is not None and points[ab]:
            claims.append(
                _ordering(f"DP-AdamBC (true Phi) > DP-Adam-Biased at the best of {what}", true, points[ab])
            )
    return claims


def _best(cells: dict) -> SeedStats:
    """The point with the highest mean accuracy."""
    return max(cells.values(), key=lambda c: c.mean)


def _ordering(text: str, better: SeedStats, rivals: dict, strict: bool = True) -> Claim:
    """``better`` ahead of the best of ``rivals``, with Welch's test of the two."""
    return ordering_claim(Ordering(None, None, text, strict), better, _best(rivals))


def _phi_claims(true: SeedStats, phi: dict, phi_true: float) -> list[Claim]:
    """Subtracting more than the true Phi hurts; subtracting less does not help (the best of each side)."""
    over = {x: c for x, c in phi.items() if x > phi_true * 1.01}
    under = {x: c for x, c in phi.items() if x < phi_true / 1.01}
    claims = []
    if over:
        claims.append(
            _ordering(
                "subtracting more than the true Phi hurts: accuracy(true Phi) > accuracy(Phi' > Phi)",
                true,
                over,
            )
        )
    if under:
        text = (
            "subtracting less than the true Phi (towards DP-Adam-Biased) does not help: "
            "accuracy(true Phi) >= accuracy(Phi' < Phi)"
        )
        claims.append(_ordering(text, true, under, strict=False))
    return claims


def _beta_claim(beta: dict) -> list[Claim]:
    """beta2 = 0.99 at least as good as the best other beta2 of the sweep; the detail lists the sweep."""
    if len(beta) < 2 or 0.99 not in beta:
        return []
    claim = _ordering(
        "DP-Adam-Biased: beta2 = 0.99 is the best of the beta sweep",
        beta[0.99],
        {x: c for x, c in beta.items() if x != 0.99},
        strict=False,
    )
    sweep = ", ".join(f"beta2 {x:g}: {c.mean:.2f}" for x, c in sorted(beta.items()))
    return [replace(claim, detail=f"{sweep}; {claim.detail}")]


def _spread_claim(gamma_bc: dict, gamma_biased: dict) -> list[Claim]:
    """The accuracy's spread (max - min) over the gamma' grid above that over the gamma grid. A gap between two
    spreads is no comparison of two cells, so Welch's t does not test it: the claim is untested (with one seed a
    point, in the Gap's own words)."""
    if len(gamma_bc) < 2 or len(gamma_biased) < 2:
        return []
    (lo_bc, hi_bc), (lo_b, hi_b) = (
        (min(c.mean for c in g.values()), max(c.mean for c in g.values())) for g in (gamma_bc, gamma_biased)
    )
    n_bc, n_b = min(c.n for c in gamma_bc.values()), min(c.n for c in gamma_biased.values())
    g = Gap((hi_bc - lo_bc) - (hi_b - lo_b), n_bc, n_b)
    no_test = (
        g.test()
        if min(n_bc, n_b) < 2
        else f"no test: {n_bc} / {n_b} seeds, and Welch's t compares two cells, not the spreads of two grids"
    )
    way = "the paper's direction" if g.diff > 0 else "against the paper's direction"
    return [
        Claim.compared(
            "gamma' matters more to DP-AdamBC than gamma to DP-Adam-Biased: spread over the gamma' grid > "
            "spread over the gamma grid",
            UNTESTED,
            f"{hi_bc - lo_bc:.2f} ({lo_bc:.2f}-{hi_bc:.2f}) vs {hi_b - lo_b:.2f} ({lo_b:.2f}-{hi_b:.2f}), {way}; "
            f"{no_test}",
        )
    ]


#: the seeds note's words after the profile, and those of the rule before the shared one (< 2 points: not checked)
SEEDS_NOTE = (
    ": one seed gives a point no spread, and a claim on such a point no test (Welch's t needs 2 seeds a cell; the "
    "tang_fig1_{dataset} runs show the seed noise at this setting)."
)
OLD_SEEDS_NOTE = (
    ": a claim whose two sides differ by less than 2 points is marked not checked (see the std of the "
    "tang_fig1_{dataset} runs)."
)


def notes_for(claims, frame: pd.DataFrame, found, dataset: str, profile: str) -> list[str]:
    """The table's notes: the rule and what the seeds cannot decide, the seeds a point, the setting and learning
    rates the ablations share, whether the runs left chance, then the runs left out."""
    fig1 = f"results/{'' if profile == 'cpu' else profile + '/'}tang_fig1_{dataset}.md"
    notes = [
        *rule_notes(claims, WHAT),
        f"{_seeds_per_point(frame['n'])} per point on the {profile} profile{SEEDS_NOTE.format(dataset=dataset)}",
        f"Ablations run at the tang_fig1_{dataset} setting of this profile; see {fig1}.",
    ]
    lrs = {}
    for r in found.complete:
        lrs.setdefault(r.config["optimizer"]["name"], set()).add(float(r.config["optimizer"]["lr"]))
    if lrs:
        notes.append(
            "Learning rates: "
            + ", ".join(
                f"{opt} eta = {'/'.join(f'{v:g}' for v in sorted(v))}" for opt, v in sorted(lrs.items())
            )
            + " at every point; the paper re-tunes eta coarsely for the Phi' and beta points."
        )
    chance = CHANCE.get(dataset)
    if chance is not None and len(frame) and float(frame["test_accuracy"].max()) < chance + 5:
        notes.append(
            f"Every point is within 5 points of chance ({chance:.1f} %): at this budget the runs have not left "
            "chance level, so this profile does not test the paper's Fig. 3; the paper profile does."
        )
    return notes + incomplete_note(found.incomplete)


def _figure(df: pd.DataFrame, table_id: str, phi_true: float, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (ab, title) in zip(axes, ABLATIONS.items(), strict=True):
        s = df[df.ablation == ab].sort_values("x")
        if len(s):
            ax.errorbar(s.x, s.test_accuracy, yerr=s[STD].astype(float).fillna(0), marker="o")
            ax.set_xscale("log" if ab != "beta" else "linear")
        if ab == "phi":
            ax.axvline(phi_true, color="gray", ls=":", label="true Phi")
            ax.legend(fontsize=8)
        ax.set(title=title, xlabel=ab, ylabel="test accuracy (%)")
        ax.title.set_fontsize(9)
    fig.tight_layout()
    return save_figure(fig, table_id, out)


def restated_notes(old: list[str], claims: list[Claim], dataset: str) -> list[str]:
    """A re-stated table's notes: the seeds note in the new words, the rule's notes in place of the old."""
    seeds = [
        n.replace(OLD_SEEDS_NOTE.format(dataset=dataset), SEEDS_NOTE.format(dataset=dataset)) for n in old
    ]
    return restated_rule_notes(seeds, claims, (), WHAT)


def paper_phi(dataset: str) -> float:
    """The paper's true Phi for ``dataset`` (configs/paper/tang.yaml)."""
    s = load_paper("tang")["settings"][dataset]
    return true_phi(s["sigma"], s["clip"], s["batch_size"])


# The true Phi is the paper's on every profile: the presets keep the paper's C and sigma / B
# (configs/experiment/tang_fig1_<dataset>.yaml), and the CSV does not say which Phi' point is the true one.
for _dataset in ("snli", "cifar10"):
    register(
        Restatement(
            f"tang_fig3_{_dataset}",
            spreads={"std": (STD, "population")},
            claims=lambda frame, d=_dataset: claims_from_frame(frame, paper_phi(d)),
            notes=lambda old, claims, d=_dataset: restated_notes(old, claims, d),
            digits=3,
        )
    )
