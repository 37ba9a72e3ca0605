"""Ganesh, McMahan & Thakurta §5.2, Fig. 3 against the number of steps: from which horizon do its claims hold here?

Fig. 3's claims are made at ~2,000 steps (B = 2048); the CPU profile of ``ganesh_fig3`` runs 32. This table reads
the preset ``ganesh_fig3_horizon`` (the same setting with more or fewer training abstracts at the same number of
epochs: each example participates as often, so the epsilon is the same at every horizon, and only the number of
steps grows), together with ``ganesh_fig3``'s own runs where the preset does not run their horizon itself (the
paper profile's ~2,000 steps; the cpu profile runs all of its horizons on its own grid). Within each (row,
column, horizon) the preset's selection rule picks the setting (the paper's: the lowest mean loss over seeds;
the horizon preset scores val-split abstracts beside the test ones in every run and selects on ``val_loss``,
then reports the chosen setting's ``test_loss``, so every horizon is tuned on a split the table does not
report). Two gaps are followed as the horizon grows, each with Welch's test over seeds:

* STP - post-processing (Alg. 8 against plain DP-Adam, independent noise at BandMF's sigma): the paper finds it
  negative (scale-then-privatize has the lowest loss);
* BandMF - DP-SGD for post-processing DP-Adam at the same epsilon: the paper finds it negative.

The paper profile adds the other cells of its main comparisons (BC, STP under BandMF, DP-SGD with momentum) and
their gaps. For each gap the report states the first horizon from which it has the paper's sign beyond seed noise
(Welch's t, p < 0.05: :mod:`dp_adam_bench.report.stats`) at every longer horizon, or that it does not within the
horizons run, and what a straight line through the gap against log2(steps) says (an extrapolation, labelled as
one). The diagnostics that explain STP
(its scaled per-example norms against its clip, the fraction clipped, where sqrt(v^) exceeds eps_s1) and BC / IME
(the fraction of negative v^ - Phi coordinates, Ganesh §4.4) are tabulated per horizon from the run logs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from dp_adam_bench.report import stats
from dp_adam_bench.report.aggregate import (
    Cell,
    chosen_runs,
    get,
    reported_on,
    select_cells,
    tuning_runs,
)
from dp_adam_bench.report.common import Claim, incomplete_note, markdown_table, save_figure
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
from dp_adam_bench.report.restate import Markdown, parse_markdown, restated_frame
from dp_adam_bench.report.restate_md import MdRestatement, read_markdown_table, replaced, section
from dp_adam_bench.report.restate_md import register as register_reading_md
from dp_adam_bench.report.skeleton import GRID_EXACT, SeedStats, Table, gap, restated_rule_notes, rule_notes
from dp_adam_bench.report.welch_columns import COLUMNS as WELCH_COLUMNS
from dp_adam_bench.report.welch_columns import welch_columns

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
STD = f"{REPORTED}{stats.STD_SUFFIX}"


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
        Claim.exact(
            f"{GRID} {where}: the chosen value is inside its grid", inside, detail, GRID_EXACT, from_runs=True
        )
        for where, inside, detail, size in positions
        if size > 2
    ]


def cell_stats(cells: dict[tuple[str, str, int], Cell]) -> dict[tuple[str, str, int], SeedStats]:
    """Each cell's test loss over its seeds (mean, sample std, n): what the table's CSV holds of it."""
    return {place: SeedStats(c.mean, c.std, c.n) for place, c in cells.items()}


def cells_from_frame(frame: pd.DataFrame) -> dict[tuple[str, str, int], SeedStats]:
    """{(row, column, steps): test loss over seeds} from a table written by :func:`cell_table` (the CSV, or the
    held-out section's cells)."""
    return {
        (r["row"], r["column"], int(r["steps"])): SeedStats.from_row(r, mean=REPORTED, std=STD)
        for r in frame.to_dict("records")
    }


def gaps(cells: dict[tuple[str, str, int], SeedStats]) -> list[tuple[str, str, int, stats.Gap]]:
    """(name, what, steps, Welch's test of first - second) for every gap at every horizon where both of its cells
    are, in :data:`GAPS`' order and by horizon."""
    horizons = sorted({k[2] for k in cells})
    return [
        (name, what, h, gap(cells[(*a, h)], cells[(*b, h)]))
        for name, what, a, b in GAPS
        for h in horizons
        if (*a, h) in cells and (*b, h) in cells
    ]


GAP_COLUMNS = ["gap", "what", "steps", "difference", "n", "verdict", *WELCH_COLUMNS]


def gap_table(cells: dict[tuple[str, str, int], SeedStats]) -> pd.DataFrame:
    """Every gap at every horizon where both of its cells are: the difference, its Welch test over the seeds,
    whether it is beyond seed noise (decided: p < 0.05) with the paper's sign, and where not, the seeds a cell that
    would decide it (if the gap and spread seen were the truth)."""
    rows = [
        {
            "gap": name,
            "what": what,
            "steps": h,
            "difference": g.diff,
            "n": min(g.n_a, g.n_b),
            "verdict": _verdict(g),
            **welch_columns(g),
        }
        for name, what, h, g in gaps(cells)
    ]
    return pd.DataFrame(rows, columns=GAP_COLUMNS)


def _verdict(g: stats.Gap) -> str:
    """The gap's state (:func:`stats.state`), the paper's sign being negative."""
    return stats.state(stats.flipped(g))


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


#: a gap claim's statement: where it holds (or that it does not) is its detail's first words
GAP_CLAIM = (
    "[ours] {what}: negative (the paper's sign) beyond seed noise at every horizon from some horizon run on"
)


def gap_claims(cells: dict[tuple[str, str, int], SeedStats]) -> list[Claim]:
    """Per gap: the first horizon from which it has the paper's sign beyond seed noise (Welch's p < 0.05) at every
    longer horizon run, each horizon's test, the trend, and the flag where the longest horizon is undecided."""
    by_gap: dict[str, list] = {}
    for name, what, h, g in gaps(cells):
        by_gap.setdefault(name, []).append((what, h, g))
    return [_gap_claim(by_gap[name]) for name, *_ in GAPS if name in by_gap]


def _gap_claim(per_horizon: list) -> Claim:
    """Holds from the first horizon on which every longer one holds; so it holds when the longest horizon does,
    and is otherwise in that horizon's state."""
    what, steps = per_horizon[0][0], [h for _, h, _ in per_horizon]
    good = [_verdict(g) == stats.HOLDS for _, _, g in per_horizon]
    first = next((i for i in range(len(good)) if all(good[i:])), None)
    where = f"from {steps[first]} steps on" if first is not None else "at none of the horizons run"
    last = per_horizon[-1][2]
    detail = [
        f"{where}; its state is the longest horizon's ({steps[-1]} steps: {_gap_text(last)})",
        *(f"{h} steps: {_gap_text(g)}" for _, h, g in per_horizon),
    ]
    fit = trend(steps, [g.diff for _, _, g in per_horizon])
    if fit is not None:
        cross = (
            ""
            if fit[1] is None
            else f" (a straight line would cross zero near {fit[1]:,.0f} steps: an extrapolation)"
        )
        detail.append(f"trend {fit[0]:+.4f} per doubling of the steps{cross}")
    if last.flag():
        detail.append(f"at {steps[-1]} steps {last.flag()}")
    return Claim.compared(GAP_CLAIM.format(what=what), _verdict(last), "; ".join(detail))


def _gap_text(g: stats.Gap) -> str:
    """``-0.0096 ± 0.0020, t = -4.79 (Welch, df 1.0), p = 0.13 over 2 / 2 seeds``: the gap, its standard error
    and its test."""
    return f"{g.diff:+.4f}" + ("" if g.se is None else f" ± {g.se:.4f}") + f", {g.test()}"


def heldout_claims(cells: dict[tuple[str, str, int], SeedStats], seeds) -> list[Claim]:
    """Per gap and horizon with held-out runs: the paper's sign beyond seed noise (Welch's p < 0.05) on the seeds
    no choice saw."""
    seeds_text = ", ".join(map(str, sorted(seeds)))
    return [
        Claim.compared(
            f"[held-out seeds] {what}, {h} steps: negative (the paper's sign) beyond seed noise",
            _verdict(g),
            f"{_gap_text(g)} (seeds {seeds_text}), each cell at the setting seeds outside them chose"
            + (f"; {g.flag()}" if g.flag() else ""),
        )
        for _, what, h, g in gaps(cells)
    ]


def claims_from_frames(frame: pd.DataFrame, heldout: pd.DataFrame | None, seeds) -> list[Claim]:
    """The gap claims on the table's cells (its CSV) and the held-out ones on the held-out section's cells."""
    held = heldout_claims(cells_from_frame(heldout), seeds) if heldout is not None and len(heldout) else []
    return gap_claims(cells_from_frame(frame)) + held


def cell_table(cells: dict) -> pd.DataFrame:
    """One row per (row, column, steps) cell, by horizon, row and the paper's column order: its test loss (mean,
    sample std, n over seeds) and the chosen setting."""
    order = sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0], COLUMNS.index(kv[0][1])))
    return pd.DataFrame(
        [
            {
                "steps": h,
                "row": row,
                "column": col,
                REPORTED: c.mean,
                STD: c.std,
                "n": c.n,
                "chosen": named(c.chosen),
            }
            for (row, col, h), c in order
        ],
        columns=["steps", "row", "column", REPORTED, STD, "n", "chosen"],
    )


def heldout_table(found: Study) -> pd.DataFrame | None:
    """The held-out cells (a :func:`cell_table`) as the held-out section prints them; None without any. Their
    claims and gaps read these printed numbers: the CSV does not hold these cells, so a re-statement of the table
    reads them from the md, and both read the same numbers."""
    return as_printed(cell_table(found.heldout)) if found.heldout else None


def as_printed(cells: pd.DataFrame) -> pd.DataFrame:
    """``cells`` with the numbers :func:`markdown_table` prints (4 decimals, or 4 significant digits)."""
    return read_markdown_table(markdown_table(cells, 4))


def heldout_section(heldout: pd.DataFrame | None) -> str:
    """The held-out cells (a :func:`cell_table`) and their gaps, or a line saying none has run."""
    if heldout is None or not len(heldout):
        return "(no held-out run at a chosen setting yet)"
    held_gaps = gap_table(cells_from_frame(heldout))
    out = markdown_table(heldout, 4)
    if len(held_gaps):
        out += "\n\n" + markdown_table(held_gaps, 4)
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
    command = f"make reproduce-table TABLE={TABLE_ID} PROFILE={ctx.profile}"
    setting = profile_setting(ctx.profile)
    found = study(ctx, setting)
    if not found.records:
        raise FileNotFoundError(f"no complete runs in {ctx.where(found.runs.spec.name)}; run `{command}`")
    frame = cell_table(found.cells)
    heldout = heldout_table(found)
    seeds = found.runs.spec.selection.heldout_seeds
    positions = grid_positions(found.own)
    claims = claims_from_frames(frame, heldout, seeds) + grid_claims(positions)
    diag = diagnostics_table(found.records, found.cells, setting)
    horizons = sorted({k[2] for k in found.cells})
    return Table(
        TABLE_ID,
        "Ganesh et al. Fig. 3 against the number of steps: test loss and the claims' gaps",
        command,
        frame,
        setting=_setting_text(ctx.profile, setting, horizons, found.runs.spec, found.reads_base),
        claims=claims,
        notes=notes_for(claims, found, positions, diag, ctx.profile),
        figure=_figure(found.cells, gap_table(cells_from_frame(frame)), ctx.out),
        digits=4,
        extra_sections=_sections(found, frame, heldout, diag, setting),
        missing=found.missing,
    ).write(ctx.out)


#: the heading of the gap section (and, before the shared rule, its first words)
GAPS_HEADING = (
    "The gaps (first - second; the paper finds each negative; beyond seed noise = decided by Welch's t, p < 0.05; "
    "seeds to decide: seeds a cell at which the gap and spread seen would be decided)"
)
OLD_GAPS_HEADING = (
    "The gaps (first - second; the paper finds each negative; 'beyond seed noise' = |d| > 2 SE;"
)
HELDOUT_HEADING = (
    "Held-out seeds ({seeds}): each cell at the setting the other seeds chose, scored on test abstracts; no choice "
    "saw these runs"
)


def _sections(found: Study, frame: pd.DataFrame, heldout, diag: pd.DataFrame, setting: dict) -> list:
    """The held-out seeds' cells and gaps, the gaps, every horizon's tuning, the diagnostics."""
    runs, seeds = found.runs, found.runs.spec.selection.heldout_seeds
    metric = runs.spec.selection.metric
    tuning = tuning_table(tuning_runs(runs.complete, runs.spec.selection), found.own, setting, metric)
    held = (
        [(HELDOUT_HEADING.format(seeds=", ".join(map(str, seeds))), heldout_section(heldout))]
        if seeds
        else []
    )
    return held + [
        (GAPS_HEADING, gaps_section(frame)),
        (
            f"The tuning at each horizon (every grid point: mean {metric} over seeds, the rule's score, and "
            "mean test_loss" + (f"; {BASE}'s cells keep its own tuning)" if found.reads_base else ")"),
            markdown_table(tuning, 4) if len(tuning) else "(no cell has more than one grid point)",
        ),
        (
            "Diagnostics per horizon (last logged step, mean over the chosen runs; clean statistics: "
            "diagnostic, not private outputs)",
            markdown_table(diag, 4) if len(diag) else "(no diagnostics logged)",
        ),
    ]


def gaps_section(frame: pd.DataFrame) -> str:
    """The gap table of the table's cells (its CSV), or a line saying no horizon has both cells of a gap."""
    table = gap_table(cells_from_frame(frame))
    return markdown_table(table, 4) if len(table) else "(no horizon has both cells of a gap yet)"


def notes_for(claims: list[Claim], found: Study, positions, diag: pd.DataFrame, profile: str) -> list[str]:
    """The rule (on the gap claims), the tuning, the grid edges, the epsilon, the runs left out, the rows, the
    step-size reading and the held-out runs at a stale setting."""
    runs, base = found.runs, found.base
    notes = rule_notes(seed_claims(claims), WHAT) + _notes(
        profile,
        found.records,
        found.cells,
        runs.incomplete + (base.incomplete if found.reads_base else []),
        [f"{where} = {detail}" for where, inside, detail, _ in positions if not inside],
        runs.spec.selection.metric,
        found.reads_base,
    )
    notes += [n for n in (step_size_note(diag, found.cells),) if n]
    if found.stale_heldout:
        notes.append(
            "Held-out runs at a setting their cell no longer chooses (re-run them at the choice): "
            + "; ".join(found.stale_heldout)
        )
    return notes


WHAT = "the two cells of every gap"
#: the opening of a grid claim's text
GRID = "[grid]"


def seed_claims(claims: list[Claim]) -> list[Claim]:
    """The claims the seeds decide or not (the gaps; the grid claims are about the tuning grid)."""
    return [c for c in claims if not c.text.startswith(GRID)]


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
            yerr=[c.std or 0.0 for _, c in pts],  # one seed: no spread
            marker="o",
            capsize=3,
            label=f"{row} @ {col}",
        )
    axes[0].set(
        xscale="log", xlabel="steps", ylabel="test loss (mean ± sample std over seeds)", title="test loss"
    )
    axes[0].legend(fontsize=7)
    for name, what, _, _ in GAPS:
        g = gaps[gaps.gap == name].sort_values("steps")
        if g.empty:
            continue
        axes[1].errorbar(g.steps, g.difference, yerr=_welch_interval(g), marker="o", capsize=3, label=what)
    axes[1].axhline(0.0, color="k", lw=0.8)
    axes[1].set(
        xscale="log",
        xlabel="steps",
        ylabel="gap (± Welch's 95% interval over seeds)",
        title="the claims' gaps (the paper: below 0)",
    )
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, TABLE_ID, out)


def _welch_interval(g: pd.DataFrame) -> list[float]:
    """Half-width of each gap's 95% interval by Welch's t (it excludes 0 exactly when the seeds decide the gap);
    0 where there is no test."""
    return [
        0.0 if pd.isna(se) else float(se * scipy_stats.t.ppf(1 - stats.LEVEL / 2, df))
        for se, df in zip(g.se, g.df, strict=True)
    ]


# --- re-stating the committed table (dp_adam_bench/report/restate_md.py) ----------------------------------
#: a gap claim's text before the shared rule: the horizon it found (by |d| > 2 SE) was part of the statement
OLD_GAP_CLAIM = re.compile(
    r"\[ours\] (?P<what>.*): negative \(the paper's sign\) beyond seed noise "
    r"(from \d+ steps on|at none of the horizons run)"
)
HELDOUT_RESTATED = (
    "The held-out cells are re-stated from the digits this md printed (the CSV does not hold them): their sample "
    "std from the population std printed there, so their gaps' last digits may differ from the runs' own."
)


def heldout_of_md(md: Markdown) -> tuple[pd.DataFrame | None, tuple[int, ...], bool]:
    """The held-out section's cells as the md prints them (a :func:`cell_table`, the spread the sample std), its
    seeds, and whether they were printed under the old rule (a population std)."""
    found = section(md, HELDOUT_HEADING.split("(")[0])
    if found is None:
        return None, (), False
    heading, body = found
    seeds = tuple(int(x) for x in heading[heading.index("(") + 1 : heading.index(")")].split(", "))
    if not body.startswith("|"):
        return None, seeds, False
    printed = read_markdown_table(body)
    old = "std" in printed.columns
    cells = restated_frame(printed, {"std": (STD, "population")})
    return as_printed(cells), seeds, old


def gaps_in(results: Path) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """The gap tables of this study's table in ``results`` (its CSV's cells, its md's held-out cells), as
    ganesh_fig3 reads them when it is re-stated; None where the table or its held-out cells are not there."""
    csv, md = results / f"{TABLE_ID}.csv", results / f"{TABLE_ID}.md"
    if not (csv.is_file() and md.is_file()):
        return None, None
    frame = restated_frame(pd.read_csv(csv), {"std": (STD, "population")})
    heldout = heldout_of_md(parse_markdown(md.read_text()))[0]
    return gap_table(cells_from_frame(frame)), None if heldout is None else gap_table(
        cells_from_frame(heldout)
    )


def restated_claims(frame: pd.DataFrame, md: Markdown, results: Path) -> list[Claim]:
    del results
    heldout, seeds, _ = heldout_of_md(md)
    return claims_from_frames(frame, heldout, seeds)


def restated_notes(old: list[str], claims: list[Claim], md: Markdown) -> list[str]:
    notes = restated_rule_notes(old, seed_claims(claims), (), WHAT)
    return notes + ([HELDOUT_RESTATED] if heldout_of_md(md)[2] and HELDOUT_RESTATED not in notes else [])


def restated_sections(frame: pd.DataFrame, md: Markdown, results: Path) -> list[tuple[str, str]]:
    """The md's sections with the held-out cells and gaps and the gap table recomputed, the others kept."""
    del results
    heldout = heldout_of_md(md)[0]
    return replaced(
        md.sections,
        {
            HELDOUT_HEADING.split("(")[0]: lambda heading, _: (heading, heldout_section(heldout)),
            OLD_GAPS_HEADING: lambda *_: (GAPS_HEADING, gaps_section(frame)),
            GAPS_HEADING: lambda *_: (GAPS_HEADING, gaps_section(frame)),
        },
    )


def _retext(text: str) -> str:
    """A gap claim's old text in its new wording (:data:`GAP_CLAIM`); other texts as they are."""
    old = OLD_GAP_CLAIM.fullmatch(text)
    return GAP_CLAIM.format(what=old["what"]) if old else text


RESTATEMENT = MdRestatement(
    TABLE_ID,
    {"std": (STD, "population")},
    restated_claims,
    restated_notes,
    restated_sections,
    _retext,
    exact={GRID: GRID_EXACT},
)
register_reading_md(RESTATEMENT)
