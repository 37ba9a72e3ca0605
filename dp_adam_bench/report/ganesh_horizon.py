"""Ganesh, McMahan & Thakurta §5.2, Fig. 3 against the number of steps: from which horizon do its claims hold here?

Fig. 3's claims are made at ~2,000 steps (B = 2048); the CPU profile of ``ganesh_fig3`` runs 32. This table reads
the preset ``ganesh_fig3_horizon`` (the same setting with more or fewer training abstracts at the same number of
epochs: each example participates as often, so the epsilon is the same at every horizon, and only the number of
steps grows), together with ``ganesh_fig3``'s own runs where the preset does not run their horizon itself (the
paper profile's ~2,000 steps; the cpu profile runs all of its horizons on its own grid). Within each (row,
column, horizon) the preset's selection rule picks the setting (the paper's: the lowest mean loss over seeds;
the horizon preset scores val-split abstracts beside the test ones in every run and selects on ``val_loss``,
then reports the chosen setting's ``test_loss``, so every horizon is tuned on a split the table does not
report). Two gaps are followed as the horizon grows, each with its standard error over seeds:

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

import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd

from dp_adam_bench.report.aggregate import (
    Cell,
    chosen_runs,
    difference_se,
    get,
    reported_on,
    seeds_to_separate,
    select_cells,
    tuning_runs,
)
from dp_adam_bench.report.common import Claim, incomplete_note, markdown_table, save_figure, write_table
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.expected import preset_runs
from dp_adam_bench.report.ganesh_cells import (
    COLUMN_LABELS,
    COLUMNS,
    ROW_LABELS,
    cell_locator,
    named,
    profile_setting,
    steps_of,
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
    ("diag/phi", "Phi: noise variance in v^"),
    ("diag/v_clean_median", "median clean v"),
)
PHI, CLEAN_V = "Phi: noise variance in v^", "median clean v"
#: not shown for STP: its Phi is the noise of the *scaled* gradients (clip C on s_t g_i), its v^ that of the
#: unscaled ones, so v^ - Phi mixes units (diag/frac_negative_after_bc reads 1.0 for every STP run)
NOT_FOR_STP = {"diag/frac_negative_after_bc", "diag/phi"}


REPORTED = "test_loss"


def horizon_cells(records, selection, setting: dict) -> dict[tuple[str, str, int], Cell]:
    """{(row, column, steps): Cell}: the selection rule per (optimizer, noise, sigma, training abstracts). When the
    rule selects on another metric (val_loss), the cell holds the chosen setting's test_loss over its runs (its
    ``candidates`` keep the selection metric's means)."""
    if "task.train_subset" not in selection.per:  # the base table's rule: its cells are one horizon
        selection = dataclasses.replace(selection, per=(*selection.per, "task.train_subset"))
    locate = _locator(setting)
    cells = select_cells(records, selection, locate)
    return cells if selection.metric == REPORTED else reported_on(cells, records, locate, REPORTED, selection)


def heldout_cells(records, cells: dict, selection, setting: dict) -> tuple[dict, list[str]]:
    """The runs of the selection's held-out seeds at each cell's chosen setting, as cells of ``test_loss`` (mean,
    std, n over those seeds), and a line per held-out run at a setting its cell does not choose (the preset ran
    them at an earlier choice: stale). Cells without held-out runs are left out."""
    held = set(selection.heldout_seeds)
    runs = [r for r in records if get(r.config, "seed") in held]
    locate = _locator(setting)
    scored, stale = {}, []
    for place, cell in cells.items():
        here = [r for r in runs if locate(r.config) == place]
        chosen = chosen_runs(here, cell, place, locate)
        for r in here:
            if r not in chosen:
                ran = named({k: get(r.config, k) for k in cell.chosen})
                where = "/".join(map(str, place))
                stale.append(f"{where} seed {get(r.config, 'seed')}: ran {ran}, chosen {named(cell.chosen)}")
        if chosen:
            scored[place] = cell
    return reported_on(scored, runs, locate, REPORTED), stale


def _locator(setting: dict):
    """config -> (row, column, steps)."""
    cell = cell_locator(setting)

    def locate(cfg):
        subset = get(cfg, "task.train_subset")
        steps = steps_of(subset, setting) if subset is not None else None
        return (*cell(cfg), steps)

    return locate


def tuning_table(records, cells: dict, setting: dict, metric: str) -> pd.DataFrame:
    """Every grid point of every (row, column, horizon) tuned on ``metric``: its mean ``metric`` and mean test_loss
    over seeds, and which one the rule chose. Only the knobs whose values differ within a cell are named."""
    rows = []
    for place in sorted(cells, key=lambda p: (p[2], p[0], COLUMNS.index(p[1]))):
        cell = cells[place]
        if len(cell.candidates) < 2:
            continue
        varying = [k for k in cell.chosen if len({c[k] for c, _ in cell.candidates}) > 1]
        for point, score in cell.candidates:
            runs = _chosen_runs(records, dataclasses.replace(cell, chosen=point), place, setting)
            tests = [float(r.summary["metrics"][REPORTED]) for r in runs]
            rows.append(
                {
                    "steps": place[2],
                    "row": place[0],
                    "column": place[1],
                    "setting": ", ".join(f"{k.split('.')[-1]}={point[k]:g}" for k in varying),
                    metric: score,
                    REPORTED: float(np.mean(tests)) if tests else math.nan,
                    "n": len(tests),
                    "chosen": "yes" if point == cell.chosen else "",
                }
            )
    return pd.DataFrame(rows)


def grid_positions(cells: dict) -> list[tuple[str, bool, str, int]]:
    """(cell and knob, chosen strictly inside its grid, 'value of {grid}[, the top / bottom]', grid size) for every
    tuned knob with two or more values in a cell."""
    out = []
    for (row, col, h), cell in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        for knob, chosen in cell.chosen.items():
            grid = sorted({c[knob] for c, _ in cell.candidates if c[knob] is not None})
            if len(grid) < 2 or chosen is None:
                continue
            inside = grid[0] < chosen < grid[-1]
            detail = f"{chosen:g} of {{{', '.join(f'{v:g}' for v in grid)}}}"
            if not inside:
                detail += f", the {'top' if chosen == grid[-1] else 'bottom'}"
            out.append((f"{row} @ {col}, {h} steps: {knob.split('.')[-1]}", inside, detail, len(grid)))
    return out


def grid_claims(positions) -> list[Claim]:
    """A claim per knob whose grid has an inside (3+ values): the choice is inside it, not at an edge."""
    return [
        Claim(f"[grid] {where}: the chosen value is inside its grid", inside, detail)
        for where, inside, detail, size in positions
        if size > 2
    ]


def gap_table(cells: dict) -> pd.DataFrame:
    """Every gap at every horizon where both of its cells are: the difference, its standard error over seeds,
    whether it is beyond seed noise (|d| > 2 SE) with the paper's sign, and the seeds per cell at which it would be
    (:func:`aggregate.seeds_to_separate`, from the spread seen)."""
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
                    "seeds_for_2se": seeds_to_separate(ca.std, ca.n, cb.std, cb.n, d),
                }
            )
    columns = ["gap", "what", "steps", "difference", "se", "n", "verdict", "seeds_for_2se"]
    return pd.DataFrame(rows, columns=columns).astype({"seeds_for_2se": "Int64"})


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


def heldout_claims(gaps: pd.DataFrame, seeds) -> list[Claim]:
    """Per gap and horizon with held-out runs: the paper's sign beyond seed noise on the seeds no choice saw."""
    seeds_text = ", ".join(map(str, sorted(seeds)))
    claims = []
    for _, g in gaps.iterrows():
        se = None if pd.isna(g.se) else float(g.se)
        claims.append(
            Claim(
                f"[held-out seeds] {g.what}, {int(g.steps)} steps: negative (the paper's sign) beyond seed noise",
                g.verdict == "paper's sign",
                f"{g.difference:+.4f}" + ("" if se is None else f" ± {se:.4f}") + f" over seeds {seeds_text} "
                f"({int(g.n)} a cell), each cell at the setting seeds outside them chose",
            )
        )
    return claims


def cell_table(cells: dict) -> pd.DataFrame:
    """One row per (row, column, steps) cell, by horizon, row and the paper's column order: its test loss (mean,
    std, n over seeds) and the chosen setting."""
    order = sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0], COLUMNS.index(kv[0][1])))
    return pd.DataFrame(
        [
            {
                "steps": h,
                "row": row,
                "column": col,
                "test_loss": c.mean,
                "std": c.std,
                "n": c.n,
                "chosen": named(c.chosen),
            }
            for (row, col, h), c in order
        ]
    )


def _heldout_markdown(heldout: dict, gaps: pd.DataFrame) -> str:
    """The held-out cells and their gaps, or a line saying none has run."""
    if not heldout:
        return "(no held-out run at a chosen setting yet)"
    cells = cell_table(heldout)
    out = markdown_table(cells, 4)
    if len(gaps):
        out += "\n\n" + markdown_table(gaps, 4)
    return out


def _chosen_runs(records, cell: Cell, place, setting: dict) -> list:
    """The runs behind ``cell``: its group's runs at the chosen setting."""
    return chosen_runs(records, cell, place, _locator(setting))


def diagnostics_table(records, cells: dict, setting: dict) -> pd.DataFrame:
    """The last logged value of each diagnostic, averaged over the chosen runs of every (row, column, horizon)."""
    rows = []
    for place in sorted(cells, key=lambda p: (p[0], COLUMNS.index(p[1]), p[2])):
        runs = _chosen_runs(records, cells[place], place, setting)
        line = {"row": place[0], "column": place[1], "steps": place[2]}
        logs = [r.metrics() for r in runs]  # each run's metrics file read once
        for key, label in DIAGNOSTICS:
            if place[0] == "stp" and key in NOT_FOR_STP:
                continue
            vals = [v for v in (_last(m, key) for m in logs) if v is not None]
            if vals:
                line[label] = float(np.mean(vals))
        if len(line) > 3:
            rows.append(line)
    return pd.DataFrame(rows)


def step_size_note(diag: pd.DataFrame, cells: dict) -> str | None:
    """Why post-processing under BandMF needs its own eta, from the diagnostics: post-processing DP-Adam's v^ is
    the noise variance Phi plus the clean v; where Phi dominates, a step is ~ eta m^ / sqrt(Phi), and BandMF at the
    same sigma adds more noise a step than independent noise (the rows of C^-1 have norm >= 1), so at one eta its
    steps are sqrt(Phi_ind / Phi_bandmf) as large. None without both cells' diagnostics at some horizon."""
    if diag.empty or PHI not in diag or CLEAN_V not in diag:
        return None
    parts = []
    for h in sorted(set(diag.steps)):
        pp = diag[(diag.steps == h) & (diag.row == "postprocessing")].set_index("column")
        if not {BANDMF, HIGH} <= set(pp.index) or pp.loc[[BANDMF, HIGH], PHI].isna().any():
            continue
        ratio = float(pp.loc[BANDMF, PHI] / pp.loc[HIGH, PHI])
        lrs = [cells.get(("postprocessing", c, h)) for c in (BANDMF, HIGH)]
        chosen = ", ".join(
            f"eta {c.chosen.get('optimizer.lr'):g} under {col}"
            for c, col in zip(lrs, ("BandMF", "independent noise"), strict=True)
            if c is not None and c.chosen.get("optimizer.lr") is not None
        )
        parts.append(
            f"{h} steps: Phi {pp.loc[BANDMF, PHI]:.3g} (BandMF) vs {pp.loc[HIGH, PHI]:.3g} (independent), "
            f"ratio {ratio:.2f}: BandMF's steps {1 / math.sqrt(ratio):.2f}x as large at one eta; median clean v "
            f"{pp.loc[HIGH, CLEAN_V]:.2g} ({pp.loc[HIGH, PHI] / pp.loc[HIGH, CLEAN_V]:.2g}x below Phi)"
            + (f"; chosen: {chosen}" if chosen else "")
        )
    if not parts:
        return None
    return (
        "Post-processing's second moment is almost all noise (Phi against the clean v below), so its step is "
        "~ eta m^ / sqrt(Phi): a mechanism that adds more noise a step takes smaller steps at the same eta. "
        "BandMF at DP-SGD's sigma does (the rows of C^-1 have norm >= 1), so the BandMF - DP-SGD gap at one eta "
        "partly compares step sizes; each horizon's eta grid lets BandMF choose a larger one. "
        + "; ".join(parts)
        + "."
    )


def _last(metrics: list[dict], key: str) -> float | None:
    for m in reversed(metrics):
        if key in m:
            return float(m[key])
    return None


@dataclasses.dataclass
class Study:
    """The study's cells, each horizon's selection made: ``cells`` every (row, column, steps), ``own`` the ones
    this preset runs; ``records`` the runs read, but those of held-out seeds; ``missing`` the expected runs not
    there yet; ``heldout`` the cells scored on the held-out seeds at their chosen setting (``stale_heldout``: the
    held-out runs at another setting)."""

    runs: object
    base: object
    records: list
    cells: dict
    own: dict
    reads_base: bool
    missing: list
    heldout: dict = dataclasses.field(default_factory=dict)  # (row, column, steps) -> Cell of held-out seeds
    stale_heldout: list = dataclasses.field(default_factory=list)


def study(ctx: ReportContext, setting: dict) -> Study:
    """The runs of this preset, and the base table's runs of the cells it follows at a horizon it does not run
    itself (the paper profile's ~2,000 steps), each selected by its own preset's rule."""
    runs, base = preset_runs(ctx, PRESET), preset_runs(ctx, BASE)
    # the base table's runs of the cells this study follows add its horizon, unless this preset runs that horizon
    # itself (the cpu profile does, on its own eta grid)
    points = runs.spec.points()
    followed = {(p["optimizer"], p["noise"], float(p["privacy.sigma"])) for p in points}
    own_subsets = {p.get("task.train_subset") for p in points}
    base_subset = setting["train_subset"]
    reads_base = base_subset not in own_subsets
    shortest = [
        r
        for r in base.complete
        if reads_base
        and get(r.config, "task.train_subset") == base_subset
        and (
            get(r.config, "optimizer.name"),
            get(r.config, "noise.kind"),
            float(get(r.config, "privacy.sigma") or 0),
        )
        in followed
    ]
    # each preset's own rule: the base table's (on test_loss, one setting a cell here), this one's on val_loss
    cells = horizon_cells(shortest, base.spec.selection, setting)
    own = horizon_cells(runs.complete, runs.spec.selection, setting)
    if cells.keys() & own.keys():
        raise ValueError(f"{BASE} and {PRESET} both have runs at {sorted(cells.keys() & own.keys())}")
    missing = runs.missing + [
        m
        for opt, noise, sigma in sorted(followed)
        if reads_base
        for m in base.lacking(optimizer=opt, noise=noise, **{"privacy.sigma": sigma})
    ]
    heldout, stale = heldout_cells(runs.complete, own, runs.spec.selection, setting)
    records = shortest + tuning_runs(runs.complete, runs.spec.selection)  # the held-out runs are in `heldout`
    return Study(runs, base, records, cells | own, own, reads_base, missing, heldout, stale)


def build(ctx: ReportContext | None = None) -> list[Path]:
    ctx = ctx or ReportContext()
    profile = ctx.profile
    command = f"make reproduce-table TABLE={TABLE_ID} PROFILE={profile}"
    setting = profile_setting(profile)
    found = study(ctx, setting)
    runs, base, records, cells, own = found.runs, found.base, found.records, found.cells, found.own
    reads_base, missing = found.reads_base, found.missing
    if not records:
        raise FileNotFoundError(f"no complete runs in {ctx.where(runs.spec.name)}; run `{command}`")

    df = cell_table(cells)
    gaps = gap_table(cells)
    positions = grid_positions(own)
    seeds = runs.spec.selection.heldout_seeds
    held_gaps = gap_table(found.heldout)
    claims = gap_claims(gaps) + heldout_claims(held_gaps, seeds) + grid_claims(positions)
    diag = diagnostics_table(records, cells, setting)
    metric = runs.spec.selection.metric
    tuning = tuning_table(tuning_runs(runs.complete, runs.spec.selection), own, setting, metric)
    held_section = (
        [
            (
                f"Held-out seeds ({', '.join(map(str, seeds))}): each cell at the setting the other seeds chose, "
                "scored on test abstracts; no choice saw these runs",
                _heldout_markdown(found.heldout, held_gaps),
            )
        ]
        if seeds
        else []
    )
    fig = _figure(cells, gaps, ctx.out)
    horizons = sorted({k[2] for k in cells})
    return write_table(
        TABLE_ID,
        df,
        out=ctx.out,
        title="Ganesh et al. Fig. 3 against the number of steps: test loss and the claims' gaps",
        command=command,
        setting=_setting_text(profile, setting, horizons, runs.spec, reads_base),
        claims=claims,
        notes=_notes(
            profile,
            records,
            cells,
            runs.incomplete + (base.incomplete if reads_base else []),
            [f"{where} = {detail}" for where, inside, detail, _ in positions if not inside],
            metric,
            reads_base,
        )
        + [n for n in (step_size_note(diag, cells),) if n]
        + (
            [
                "Held-out runs at a setting their cell no longer chooses (re-run them at the choice): "
                + "; ".join(found.stale_heldout)
            ]
            if found.stale_heldout
            else []
        ),
        figure=fig,
        digits=4,
        extra_sections=held_section
        + [
            (
                "The gaps (first - second; the paper finds each negative; 'beyond seed noise' = |d| > 2 SE; "
                "seeds_for_2se: seeds per cell at which |d| would be 2 SE, from the spread between these seeds, a "
                "rough count)",
                markdown_table(gaps, 4) if len(gaps) else "(no horizon has both cells of a gap yet)",
            ),
            (
                f"The tuning at each horizon (every grid point: mean {metric} over seeds, the rule's score, and "
                "mean test_loss" + (f"; {BASE}'s cells keep its own tuning)" if reads_base else ")"),
                markdown_table(tuning, 4) if len(tuning) else "(no cell has more than one grid point)",
            ),
            (
                "Diagnostics per horizon (last logged step, mean over the chosen runs; clean statistics: "
                "diagnostic, not private outputs)",
                markdown_table(diag, 4) if len(diag) else "(no diagnostics logged)",
            ),
        ],
        missing=missing,
    )


def _setting_text(profile: str, s: dict, horizons: list[int], spec, reads_base: bool) -> str:
    seeds = len(spec.seeds or [0])
    return (
        f"profile {profile}: the ganesh_fig3 setting ({s['max_length']} tokens, B = {s['batch_size']}, "
        f"{s['epochs']} epochs, BandMF b = {s['bands']}, sigma {s['sigma_high']:g} for DP-SGD at "
        f"BandMF's epsilon and for BandMF) at {', '.join(map(str, horizons))} steps (more or fewer training "
        f"abstracts, the same epochs: the same epsilon at every horizon)"
        + (
            f"; the {steps_of(s['train_subset'], s)}-step horizon is {BASE}'s own runs. "
            if reads_base
            else ", every horizon run by this preset. "
        )
        + f"{seeds} seeds per setting; each cell's settings (clip included) in its 'chosen' column. Rows and "
        "columns are ganesh_fig3's: "
        + "; ".join(f"{c} = {COLUMN_LABELS[c]}" for c in COLUMNS if c != LOW)
        + "."
    )


def _notes(
    profile: str, records, cells, incomplete, edges: list[str], metric: str, reads_base: bool
) -> list[str]:
    notes = [
        f"Tuning: the horizons this preset runs choose their setting by the lowest mean {metric} over seeds and "
        f"report that setting's {REPORTED}"
        + (
            f"; {BASE}'s runs (its horizon) keep the values its own selection rule chose."
            if reads_base
            else f" (every horizon here, {BASE}'s included: its own runs are not read)."
        )
    ]
    if profile == "cpu":
        notes.append(
            "CPU profile: only the learning rate is re-tuned at each horizon; STP's eps_s1 and clip and DP-SGD's "
            "momentum stay as ganesh_fig3_tuning chose them at 32 steps (the CPU cannot afford their grids at every "
            "horizon)."
        )
    if edges:
        notes.append(
            "Chosen at an end of its grid (a wider grid could still move these cells): "
            + "; ".join(edges)
            + "."
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
