"""Ganesh, McMahan & Thakurta §5.2, Fig. 3: private Adam variants × noise mechanisms, BERT-tiny MLM, test loss.

Reads ``runs/ganesh_fig3_<profile>`` (preset ``configs/experiment/ganesh_fig3.yaml``). A cell is (row, column):
the row is the optimizer (private or not), the column the mechanism (DP-SGD at BandMF's RMSE, BandMF, DP-SGD at
BandMF's epsilon), told apart by ``noise.kind`` and ``privacy.sigma``. Within a cell the tuned settings (eta,
eps_s, clip, momentum) are selected by the preset's ``sweep.selection`` (the lowest mean final test loss over
seeds, as the paper does); the table
prints that setting's mean ± sample std beside the paper's number, and the paper's claims are checked on ours (and, as a
sanity check of their wording, on the paper's own numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from dp_adam_bench.report import aggregate, ganesh_horizon, stats
from dp_adam_bench.report.aggregate import Cell, get, select_cells
from dp_adam_bench.report.common import Claim, incomplete_note, load_paper, markdown_table
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.expected import preset_runs
from dp_adam_bench.report.ganesh_cells import (  # noqa: F401 - ganesh_fig3's names, re-exported for its readers
    COLUMN_LABELS,
    COLUMNS,
    DP_ROWS,
    ROW_LABELS,
    ROWS,
    cell_locator,
    column_of,
    named,
    profile_setting,
    row_of,
    steps_of,
)
from dp_adam_bench.report.ganesh_differs import differs_section, step_paragraph, step_reading
from dp_adam_bench.report.ganesh_steps import effective_steps, order_reading
from dp_adam_bench.report.restate import Markdown
from dp_adam_bench.report.restate_md import MdRestatement, replaced
from dp_adam_bench.report.restate_md import register as register_reading_md
from dp_adam_bench.report.skeleton import (
    Ordering,
    SeedStats,
    Table,
    complete_runs,
    gap,
    ordering_claim,
    restated_rule_notes,
    rule_notes,
)
from dp_adam_bench.report.stats import LEVEL, STD_SUFFIX
from dp_adam_bench.report.welch_columns import COLUMNS as WELCH_COLUMNS
from dp_adam_bench.report.welch_columns import welch_columns
from dp_adam_bench.sweep import Selection, load_preset

TABLE_ID = "ganesh_fig3"
STD = f"ours{STD_SUFFIX}"


def cells_for(
    records, selection: Selection, sigma_low: float, sigma_high: float
) -> dict[tuple[str, str], Cell]:
    """{(row, column): Cell}: the preset's selection rule within each of its groups (optimizer, noise, sigma),
    each group being one cell of the paper's table."""
    return select_cells(records, selection, cell_locator({"sigma_low": sigma_low, "sigma_high": sigma_high}))


def initial_loss(records) -> SeedStats | None:
    """Test loss of the model before training (step-0 evaluation, ``train.eval_at_start``) over the runs; None
    where none logged it."""
    vals = []
    for r in records:
        first = next((m for m in r.metrics() if m.get("step") == 0 and "test_loss" in m), None)
        if first is not None:
            vals.append(float(first["test_loss"]))
    return SeedStats.of(vals) if vals else None


def build(ctx: ReportContext | None = None) -> list[Path]:
    ctx = ctx or ReportContext()
    command = f"make reproduce-table TABLE={TABLE_ID} PROFILE={ctx.profile}"
    found = complete_runs(ctx, TABLE_ID, command)
    setting = profile_setting(ctx.profile)
    place = cell_locator(setting)
    cells = _selected(found, setting, place)
    frame = _frame(cells, initial_loss(found.complete), load_paper("ganesh")["fig3"]["test_loss"])
    claims = claims_from_frame(frame)
    chosen = [r for p, c in cells.items() for r in aggregate.chosen_runs(found.complete, c, p, place)]
    steps = effective_steps(chosen, place)
    horizon = ganesh_horizon.study(ctx, setting)  # read once: the wider-grid note and the differs section
    return Table(
        TABLE_ID,
        "Ganesh et al. Fig. 3 — masked-token prediction on arXiv abstracts (the paper: TinyBERT): test loss",
        command,
        frame,
        setting=_setting_text(ctx.profile, setting, found.complete, len(found.spec.seeds or [0])),
        claims=claims,
        notes=notes_for(claims, frame, cells, steps, horizon, found, ctx),
        digits=3,
        extra_sections=[
            (DIFFERS, differs_section(claims, step_reading(steps), *_horizon_gaps(horizon))),
            *_cell_sections(frame, found.complete, setting),
            (
                "Effective steps: the factor a steady privatized gradient is multiplied by, from the logged v^ "
                "(Adam variants: eta over their denominator at that coordinate; DP-SGD: lr / (1 - momentum))",
                markdown_table(steps, 4) if len(steps) else "(no second moments logged)",
            ),
        ],
        missing=found.missing,
    ).write(ctx.out)


def _selected(found, setting: dict, place) -> dict[tuple[str, str], Cell]:
    """The preset's selection in every cell; selected on val abstracts, a cell holds the chosen setting's test
    loss."""
    cells = cells_for(
        found.complete, found.spec.selection, float(setting["sigma_low"]), float(setting["sigma_high"])
    )
    if found.spec.selection.metric != "test_loss":  # selected on val abstracts: the table gives the test loss
        cells = aggregate.reported_on(cells, found.complete, place, "test_loss", found.spec.selection)
    return cells


def _frame(cells: dict, init: SeedStats | None, paper: dict) -> pd.DataFrame:
    """One row per (row, column) the paper or we have: the paper's test loss beside our mean, sample std over
    seeds, seeds and chosen setting ('no fine-tuning': the initial model, in the first column)."""
    rows = []
    for row in ["no_finetuning", *ROWS]:
        for col in COLUMNS:
            p = (paper.get(row) or {}).get(col)
            cell = cells.get((row, col))
            if row == "no_finetuning":
                cell = init if col == COLUMNS[0] else None
            if p is None and cell is None:
                continue
            rows.append(
                {
                    "row": row,
                    "column": col,
                    "paper": p,
                    "ours": cell.mean if cell else None,
                    STD: cell.std if cell else None,
                    "n": cell.n if cell else None,
                    "chosen": named(getattr(cell, "chosen", None) or {}),
                }
            )
    df = pd.DataFrame(rows, columns=["row", "column", "paper", "ours", STD, "n", "chosen"])
    df["ours_minus_paper"] = df["ours"] - df["paper"]
    df["n"] = df["n"].astype("Int64")
    return df


def _cell_stats(frame: pd.DataFrame) -> tuple[dict, dict]:
    """({(row, column): our test loss over seeds}, {(row, column): the paper's}), from the table's own rows."""
    rows = frame.to_dict("records")
    ours = {(r["row"], r["column"]): SeedStats.from_row(r, std=STD) for r in rows if not pd.isna(r["ours"])}
    paper = {(r["row"], r["column"]): float(r["paper"]) for r in rows if not pd.isna(r["paper"])}
    return ours, paper


def claims_from_frame(frame: pd.DataFrame, pairs: list | None = None) -> list[Claim]:
    """The paper's Fig. 3 statements on our cells (Welch's t over the seeds) and, as a check of their wording, on
    the paper's own numbers; every pair of our cells compared is appended to ``pairs``."""
    ours, paper = _cell_stats(frame)
    # the checks on the paper's own numbers do not depend on our runs: never incomplete
    paper_claims = [replace(c, from_runs=False) for c in _claims(paper, "paper")]
    return _claims({k: c.mean for k, c in ours.items()}, "ours", ours, pairs) + paper_claims


def _claims(values: dict, who: str, cells: dict | None = None, pairs: list | None = None) -> list[Claim]:
    """The paper's Fig. 3 statements as inequalities on a {(row, column): loss} table; with ``cells`` (our cells
    over seeds) each ordering carries Welch's test and, where the seeds do not decide it, the flag."""
    compare = _Compare(values, who, cells, pairs)
    out = []
    for col in COLUMNS:
        dp = [r for r in DP_ROWS if (r, col) in values]
        if "stp" in dp and len(dp) > 1:
            runner = min((r for r in dp if r != "stp"), key=lambda r: values[(r, col)])
            out.append(
                compare(
                    f"{COLUMN_LABELS[col]}: scale-then-privatize has the lowest loss of the DP variants",
                    ("stp", col),
                    (runner, col),
                    f"stp vs best other ({runner}): ",
                )
            )
        if ("ime", col) in values and ("postprocessing", col) in values:
            out.append(
                compare(
                    f"{COLUMN_LABELS[col]}: IME is worse than post-processing",
                    ("postprocessing", col),
                    ("ime", col),
                    "post-processing vs ime: ",
                )
            )
        if ("postprocessing", col) in values and ("dpsgd_momentum", col) in values:
            out.append(
                compare(
                    f"{COLUMN_LABELS[col]}: DP-Adam (post-processing) beats DP-SGD with momentum",
                    ("postprocessing", col),
                    ("dpsgd_momentum", col),
                    "post-processing vs DP-SGD: ",
                )
            )
    out += compare.every_row(
        "DP-BandMF beats DP-SGD at the same epsilon for every DP variant",
        [
            ((r, COLUMNS[1]), (r, COLUMNS[2]))
            for r in DP_ROWS
            if (r, COLUMNS[1]) in values and (r, COLUMNS[2]) in values
        ],
    )
    c0 = COLUMNS[0]
    if ("nonprivate_adam", c0) in values and ("nonprivate_sgd", c0) in values:
        out.append(
            compare("non-private Adam beats non-private SGD", ("nonprivate_adam", c0), ("nonprivate_sgd", c0))
        )
    return out


@dataclass
class _Compare:
    """One statement of :func:`_claims`: ``better`` has the lower loss. On the paper's numbers the two losses; on
    ours (``cells``) Welch's test of the two cells too (:func:`~dp_adam_bench.report.skeleton.ordering_claim`)."""

    values: dict
    who: str
    cells: dict | None
    pairs: list | None

    def __call__(self, text: str, better, worse, label: str = "") -> Claim:
        text = f"[{self.who}] {text}"
        if self.pairs is not None:
            self.pairs.append((better, worse))
        if self.cells is None:
            return Claim.exact(
                text,
                self.values[better] < self.values[worse],
                f"{label}{self.values[better]:.3f} vs {self.values[worse]:.3f}",
                PAPER_EXACT,
            )
        c = ordering_claim(
            Ordering(better, worse, text, lower_is_better=True),
            self.cells[better],
            self.cells[worse],
            digits=3,
        )
        return replace(c, detail=label + c.detail)

    def every_row(self, text: str, row_pairs: list) -> list[Claim]:
        """``better`` ahead of ``worse`` in every (better, worse) pair: the count of rows, and on ours the rows
        the seeds do not decide."""
        if not row_pairs:
            return []
        if self.pairs is not None:
            self.pairs.extend(row_pairs)
        wins = [b[0] for b, w in row_pairs if self.values[b] < self.values[w]]
        rows = [b[0] for b, _ in row_pairs]
        detail = f"{len(wins)} of {len(rows)} rows" + (
            f"; not: {', '.join(sorted(set(rows) - set(wins)))}" if len(wins) < len(rows) else ""
        )
        text = f"[{self.who}] {text}"
        if self.cells is None:
            return [Claim.exact(text, len(wins) == len(rows), detail, PAPER_EXACT)]
        # each row's gap with the paper's sign positive (a lower loss for ``better``)
        tests = [(b[0], gap(self.cells[w], self.cells[b])) for b, w in row_pairs]
        states = [stats.state(g) for _, g in tests]
        open_rows = [row for (row, g), s in zip(tests, states, strict=True) if s != stats.HOLDS]
        decided = len(rows) - len(open_rows)
        detail += f"; decided the paper's way (Welch's p < {LEVEL:g}) in {decided} of {len(rows)} rows"
        if open_rows:
            detail += (
                f"; not in {', '.join(open_rows)} (the seed section gives each row's test, its degrees of freedom "
                "and the seeds a cell that would decide it)"
            )
        return [Claim.compared(text, stats.combine(states), detail)]


def _horizon_gaps(found) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """The horizon study's gap tables (results/ganesh_fig3_horizon.md): on the tuning seeds, and on its held-out
    seeds; None where it has no runs."""
    gaps = ganesh_horizon.gap_table(ganesh_horizon.cell_stats(found.cells)) if found.cells else None
    heldout = ganesh_horizon.heldout_table(found)
    held = None if heldout is None else ganesh_horizon.gap_table(ganesh_horizon.cells_from_frame(heldout))
    return gaps, held


#: why a statement checked on the paper's own numbers is exact
PAPER_EXACT = "the paper's printed means compared as printed (Fig. 3 prints no spread over its seeds to test)"


#: the headings of the sections the table's own cells make (and the one of the differences from the paper)
DIFFERS = "Where this table differs from the paper's, and why (from the numbers below)"
PAPER_TABLE = "The table as the paper prints it (mean ± sample std over seeds)"
SEED_NOISE = "Seed noise: the comparisons of the claims"


def _cell_sections(frame: pd.DataFrame, complete, setting: dict) -> list[tuple[str, str]]:
    """The table as the paper prints it, each column's privacy, and the seed-noise section of the claims."""
    eps = _column_epsilons(complete, float(setting["sigma_low"]), float(setting["sigma_high"]))
    return [
        (PAPER_TABLE, paper_table(frame)),
        ("Privacy of each column (ours, from the run ledgers)", eps),
        (SEED_NOISE, seed_section(frame)),
    ]


def paper_table(frame: pd.DataFrame) -> str:
    """Rows x columns as the paper prints them: the paper's loss beside our mean ± sample std over seeds."""
    ours, paper = _cell_stats(frame)
    wide = []
    for row in ["no_finetuning", *ROWS]:
        line = {"row": ROW_LABELS[row]}
        for col in COLUMNS:
            p, o = paper.get((row, col)), ours.get((row, col))
            line[f"{col} paper"] = "" if p is None else f"{p:.3f}"
            line[f"{col} ours"] = (
                "" if o is None else f"{o.mean:.3f}" + ("" if o.std is None else f" ± {o.std:.3f}")
            )
        wide.append(line)
    return markdown_table(pd.DataFrame(wide))


def seed_section(frame: pd.DataFrame) -> str:
    """Every pair of cells the claims compare: the difference, Welch's test over the seeds, whether the seeds
    decide it, and where not, the seeds a cell that would if the gap and spread seen were the truth."""
    pairs: list = []
    claims_from_frame(frame, pairs)
    ours = _cell_stats(frame)[0]
    rows = [
        {
            "first": f"{a[0]} @ {a[1]}",
            "second": f"{b[0]} @ {b[1]}",
            "second - first": f"{ours[b].mean - ours[a].mean:+.4f}",
            **welch_columns(gap(ours[b], ours[a])),
        }
        for a, b in dict.fromkeys(pairs)  # in order, once each
    ]
    decided = [r[WELCH_COLUMNS[4]] for r in rows if not r[WELCH_COLUMNS[4]].startswith("no test")]
    head = (
        f"{decided.count('yes')} of {len(decided)} comparisons with at least 2 seeds a cell are decided by the "
        f"seeds (Welch's t, p < {LEVEL:g}). 'Seeds to decide': the seeds a cell at which the difference and the "
        "spread between the seeds here would be decided (two seeds estimate a spread poorly: a rough count)."
    )
    table = pd.DataFrame(rows)
    return head + "\n\n" + markdown_table(table, 4)


def notes_for(claims, frame, cells, steps, horizon, found, ctx) -> list[str]:
    """The rule (on our claims), the profile's caveats and tuning, the diverged baselines, the effective-step
    reading and the horizon study's wider grid."""
    setting = profile_setting(ctx.profile)
    tuning = preset_runs(ctx, "ganesh_fig3_tuning").complete if ctx.profile == "cpu" else []
    notes = rule_notes(ours_claims(claims), WHAT)
    notes += _notes(ctx.profile, setting, found.incomplete, found.complete, tuning)
    notes += baseline_note({k: c.mean for k, c in _cell_stats(frame)[0].items()}, cells)
    notes += [n for n in (order_reading(steps, list(COLUMNS)),) if n]
    if ctx.profile == "cpu":
        notes += wider_grid_note(horizon.runs.complete, setting, cells)
    return notes


WHAT = "the variants"


def ours_claims(claims: list[Claim]) -> list[Claim]:
    """The claims on our cells (those on the paper's own numbers have no seeds)."""
    return [c for c in claims if c.text.startswith("[ours]")]


def _column_epsilons(records, sigma_low: float, sigma_high: float) -> str:
    lines = ["| column | noise | sigma | epsilon (delta from the run) |", "|---|---|---|---|"]
    seen = set()
    for r in records:
        col = column_of(r.config, sigma_low, sigma_high)
        if col is None or get(r.config, "noise.kind") == "none" or col in seen:
            continue
        if get(r.config, "optimizer.name") not in ("adam", "sgd", "bc", "noiseless_precond"):
            continue  # IME / stp account differently (sigma / sqrt(2) for IME): the plain mechanism's epsilon
        seen.add(col)
        found = r.summary.get("epsilon") or {}
        eps = found.get("pld", next(iter(found.values()), None))  # no amplification: every accountant agrees
        lines.append(
            f"| {col} | {get(r.config, 'noise.kind')} | {get(r.config, 'privacy.sigma'):g} | "
            f"{'' if eps is None else f'{eps:.4g}'} (delta = {r.summary.get('delta')}) |"
        )
    return "\n".join(lines)


def _setting_text(profile: str, s: dict, records, n_seeds: int) -> str:
    cfg = records[0].config
    return (
        f"profile {profile}: {get(cfg, 'task.name')}, {s['max_length']} tokens, B = {s['batch_size']}, "
        f"{s['epochs']} epochs of {s['train_subset'] or 'all'} training abstracts (cyclic fixed batches, "
        f"{records[0].summary.get('steps')} steps), clip {_base_clip(records)} (STP's: its 'chosen' column), "
        f"BandMF b = {s['bands']}, "
        f"sigma {s['sigma_low']:g} / {s['sigma_high']:g} / {s['sigma_high']:g}, {n_seeds} seeds per "
        f"setting (fewer where an entry says). Paper: pretrained BERT-tiny, 512 tokens, B = 2048, 2000 steps, "
        "sigma 0.134 / 1 / 1, b = 128, 30 trials, every variant tuned."
        + (
            f" Data and model (from the runs): {note}."
            if (note := records[0].summary.get("data_note"))
            else ""
        )
    )


def _base_clip(records) -> str:
    """The clip of the non-STP private runs (STP's clip acts on scaled gradients and is tuned on its own)."""
    clips = {
        get(r.config, "privacy.clip")
        for r in records
        if get(r.config, "noise.kind") != "none"
        and not str(get(r.config, "optimizer.name")).startswith("stp")
    }
    return ", ".join(f"{c:g}" for c in sorted(c for c in clips if c is not None)) or "none"


def _notes(profile: str, s: dict, incomplete, complete, tuning=()) -> list[str]:
    notes = []
    if profile == "cpu":
        ratio = float(s["sigma_low"]) / float(s["sigma_high"])
        notes += [
            "CPU profile, the model: MiniLM-L6 (6 layers x 384, pretrained; the [minilm] extra), not the paper's "
            "TinyBERT (2 x 128), whose weights are not available offline. Its masked-LM head, which the package "
            "lacks, was fitted NON-PRIVATELY with the encoder frozen on the val split's abstracts (`dp-adam-bench "
            "pretrain minilm_mlm_head`; the runs train on the train split and are scored on the test split). 'No "
            "fine-tuning' is that model on the test abstracts; every run then fine-tunes all of it. The run "
            "folders' data note says the same.",
            f"CPU profile, the schedule: {s['epochs']} epochs of {s['train_subset']} abstracts at B = "
            f"{s['batch_size']}, {s['max_length']} tokens (the paper: ~2,000 steps of 2,048 abstracts of 512 "
            "tokens), so every loss here is a short fine-tuning's, far above the paper's.",
            f"CPU profile, the noise: sigma / B is the paper's, at B = {s['batch_size']} instead of 2,048, so each "
            "column's epsilon is far larger than the paper's (see the privacy section). The low DP-SGD sigma is "
            f"re-matched to BandMF's prefix-sum RMSE at this n and b = {s['bands']} (ratio {ratio:.3f}; the "
            "paper's 0.134 is for n = 2000, b = 128).",
            _tuning_note(profile),
        ]
        values = load_preset("ganesh_fig3", profile)["sweep"]["profiles"][profile]
        notes += tuning_agreement(tuning, s, values)
        notes += stp_explanation(complete, s) + stp_clip_evidence(tuning, s)
    notes += incomplete_note(incomplete)
    if any(r.summary.get("privacy_notes") for r in complete):
        notes += sorted(
            {f"From the run folders: {n}" for r in complete for n in r.summary.get("privacy_notes", [])}
        )
    notes.append(
        "The two 'noiseless' rows use clean (un-noised) second moments: they are non-private baselines, "
        "excluded from the 'lowest loss among DP variants' claim, as in the paper."
    )
    return notes


def baseline_note(values: dict, cells: dict) -> list[str]:
    """The noiseless baselines (run at their private row's setting, not tuned on their own) that end above the
    initial model's loss: they diverged at that setting, so their row says nothing about what a clean
    preconditioner can do. One note; empty when none did (or without the initial model's loss)."""
    start = values.get(("no_finetuning", COLUMNS[0]))
    if start is None:
        return []
    worse = []
    for row in ("noiseless_precond", "stp_noiseless_precond"):
        for col in COLUMNS:
            if (row, col) in cells and values.get((row, col), -math.inf) > start:
                ran = named(cells[(row, col)].chosen)
                worse.append(f"{row} @ {col}: {values[(row, col)]:.3f} ({ran})")
    if not worse:
        return []
    return [
        f"Above the initial model's loss ({start:.3f}), i.e. diverged at the setting they ran: "
        + "; ".join(worse)
        + ". The noiseless baselines run their private row's learning rate, not one tuned for a clean "
        "preconditioner (whose steps are far larger: its v is ~1e-7 of the noise's), so these cells are not "
        "what a clean preconditioner can do; they are in no claim."
    ]


def _tuning_note(profile: str) -> str:
    """What the CPU profile tuned, and where, from the values the preset sets (ganesh_fig3_tuning's choices)."""
    v = load_preset("ganesh_fig3", profile)["sweep"]["profiles"][profile]

    def one(key, c):
        return ", ".join(f"{x:g}" for x in v[key][c])

    per_column = "; ".join(
        f"{col}: eta PP / IME / BC / STP = {one('pp_lr', c)} / {one('ime_lr', c)} / {one('bc_lr', c)} / "
        f"{one('stp_lr', c)}, eps_s IME / BC = {one('ime_eps_s', c)} / {one('bc_eps_s', c)}, STP eps_s1 = "
        f"{one('stp_eps_s1', c)} and clip {one('stp_clip', c)}, DP-SGD lr {one('sgd_lr', c)} with momentum "
        f"{one('sgd_momentum', c)}"
        for col, c in zip(COLUMNS, ("low", "bandmf", "high"), strict=True)
    )
    return (
        "CPU profile, the tuning (the paper's rule, the lowest mean loss, on the VAL split: "
        "results/ganesh_fig3_tuning.md; one seed (two for DP-SGD's best learning rates), a smaller grid than the "
        f"paper's, per (row, column)): {per_column}. The non-private rows' learning rates are the pilots' "
        "(results/ganesh_fig3_pilots.md)."
    )


#: optimizer of a ganesh_fig3_tuning cell -> {tuned key: the ganesh_fig3 cpu key that runs it, one value list per
#: column under it}
_TUNED_KEYS = {
    "adam": {"optimizer.lr": "pp_lr"},
    "ime": {"optimizer.lr": "ime_lr", "optimizer.eps_s": "ime_eps_s"},
    "bc": {"optimizer.lr": "bc_lr", "optimizer.eps_s": "bc_eps_s"},
    "sgd": {"optimizer.lr": "sgd_lr", "optimizer.momentum": "sgd_momentum"},
    "stp": {"optimizer.lr": "stp_lr", "optimizer.eps_s1": "stp_eps_s1", "privacy.clip": "stp_clip"},
}
#: (noise, sigma level) -> the column's key under a tuned value's entry
_COLUMN_KEY = {("independent", "low"): "low", ("bandmf", "high"): "bandmf", ("independent", "high"): "high"}


def tuning_agreement(tuning, s: dict, values: dict) -> list[str]:
    """Whether the values this table ran (``values``: the preset's sweep.profiles.cpu) are what ganesh_fig3_tuning's
    runs choose now (its own selection rule): a tuning grid widened after the table ran can move a choice, and
    then the table is stale until re-run. One note, empty without tuning runs."""
    if not tuning:
        return []
    sel = load_preset("ganesh_fig3_tuning", "cpu")["sweep"]["selection"]
    chosen = aggregate.select_best(
        list(tuning), per=list(sel["per"]), tuned=list(sel["tuned"]), metric=sel["metric"], mode=sel["mode"]
    )
    low, high = float(s["sigma_low"]), float(s["sigma_high"])
    stale, checked = [], 0
    for (opt, noise, sigma), cell in chosen.items():
        col = (
            "low" if math.isclose(float(sigma), low) else "high" if math.isclose(float(sigma), high) else None
        )
        column = _COLUMN_KEY.get((noise, col))
        for knob, key in _TUNED_KEYS.get(opt, {}).items() if column else ():
            ran = (values.get(key) or {}).get(column)
            if ran is None or cell.chosen.get(knob) is None:
                continue
            checked += 1
            if not any(math.isclose(float(cell.chosen[knob]), float(x)) for x in ran):
                stale.append(
                    f"{opt} @ {noise} sigma {float(sigma):g}: {knob.split('.')[-1]} = {cell.chosen[knob]:g} chosen, "
                    f"{', '.join(f'{float(x):g}' for x in ran)} run ({key}.{column})"
                )
    if stale:
        return [
            "STALE: ganesh_fig3_tuning's runs now choose other values than this table ran (re-run after setting "
            "them under sweep.profiles.cpu of configs/experiment/ganesh_fig3.yaml): " + "; ".join(stale) + "."
        ]
    return [
        f"The tuned values this table ran are ganesh_fig3_tuning's choices ({checked} checked against its runs)."
    ]


def wider_grid_note(horizon_runs, s: dict, cells: dict) -> list[str]:
    """What the horizon study's own runs at this table's horizon (the same setting, eta tuned on a wider grid on
    val abstracts) choose for the cells both have, against what this table ran: the learning rate and the test
    losses side by side. One note; empty without such runs."""
    from dp_adam_bench.sweep import sweep_spec

    here = [r for r in horizon_runs if get(r.config, "task.train_subset") == s["train_subset"]]
    if not here:
        return []
    steps = steps_of(s["train_subset"], s)
    place = cell_locator(s)
    selection = sweep_spec("ganesh_fig3_horizon", "cpu").selection  # on val; its test loss reported
    wider = aggregate.reported_on(select_cells(here, selection, place), here, place, "test_loss", selection)
    parts = []
    for (row, col), w in sorted(wider.items()):
        ours = cells.get((row, col))
        if ours is None:
            continue
        grid = ", ".join(f"{c['optimizer.lr']:g}" for c, _ in w.candidates)
        ran, chose = ours.chosen.get("optimizer.lr"), w.chosen.get("optimizer.lr")
        parts.append(
            f"{row} @ {col}: ran eta {ran:g} (test {ours.mean:.3f}); the grid {{{grid}}} chooses {chose:g} "
            f"(test {w.mean:.3f}, {w.mean - ours.mean:+.3f})"
        )
    if not parts:
        return []
    return [
        f"The horizon study (results/ganesh_fig3_horizon.md) runs this table's {steps}-step setting again with eta "
        "chosen on val abstracts from a wider grid, for the cells its gaps need: "
        + "; ".join(parts)
        + ". Where "
        "it chooses another eta, this table's row is under-tuned by that much, and its claims on that row are "
        "re-checked there (STP - post-processing, BandMF - DP-SGD, post-processing - DP-SGD with momentum)."
    ]


#: STP's diagnostics (clean statistics, logged by its runs) that say what its clip and scale did
_STP_KEYS = ("diag/frac_clipped", "diag/norm_over_clip_median", "diag/stp_frac_sqrtv_above_eps_s1")


def stp_explanation(records, s: dict) -> list[str]:
    """Why scale-then-privatize does what it does in these runs, from their diagnostics: per column, the fraction
    of scaled per-example gradients clipped, their median norm over C, and the fraction of coordinates where
    sqrt(v^) exceeds eps_s1 (elsewhere the scale s_t = 1 / (sqrt(v^) + eps_s1) is within 2x of 1 / eps_s1)."""
    low, high = float(s["sigma_low"]), float(s["sigma_high"])
    parts, uniform = [], []
    for col in COLUMNS:
        stp = [
            r
            for r in records
            if get(r.config, "optimizer.name") == "stp" and column_of(r.config, low, high) == col
        ]
        logs = {id(r): r.metrics() for r in stp}  # each run's metrics file read once
        runs = [r for r in stp if any(_STP_KEYS[-1] in m for m in logs[id(r)])]
        means = {}
        for key in _STP_KEYS:
            vals = [float(m[key]) for r in runs for m in logs[id(r)] if m.get(key) is not None]
            if vals:
                means[key] = float(np.mean(vals))
        if len(means) < len(_STP_KEYS):
            continue
        cfg = runs[0].config
        clip, sigma = float(get(cfg, "privacy.clip")), float(get(cfg, "privacy.sigma"))
        above = means["diag/stp_frac_sqrtv_above_eps_s1"]
        uniform.append(above < 0.05)
        parts.append(
            f"{col} (eps_s1 = {float(get(cfg, 'optimizer.eps_s1')):g}, C = {clip:g}, sigma C / B = "
            f"{sigma * clip / float(s['batch_size']):.3g}): {means['diag/frac_clipped']:.1%} of the scaled "
            f"per-example gradients clipped, median norm {means['diag/norm_over_clip_median']:.3g} C, sqrt(v^) > "
            f"eps_s1 in {above:.2%} of coordinates"
        )
    if not parts:
        return []
    text = (
        "Scale-then-privatize, from its runs' diagnostics (clean statistics, means over the logged rounds; "
        "results/ganesh_figs4_6.md has them per column): " + "; ".join(parts) + "."
    )
    if all(uniform):
        text += (
            " So its scale is within 2x of the constant 1 / eps_s1 in almost every coordinate: STP clips the raw "
            "per-example gradients at about C * eps_s1 and is then close to post-processing DP-Adam: its "
            "preconditioner stays nearly flat (what STP gains or loses against post-processing comes from the "
            "few coordinates where it is not, and from Adam's eps_s2 = 1e-8). (As we read it: when every scaled "
            "gradient is clipped, the privatized gradient that feeds v^ has per-coordinate size ~ (C / B) / "
            "s_t, so sqrt(v^) falls each step by about C / ||s g|| and sigma C / B, both far below 1 here, "
            "until eps_s1 bounds the scale; Ganesh et al. §4.3.1's steady state assumes scaled gradients that "
            "are not all clipped.)"
        )
    return [text]


def stp_clip_evidence(tuning, s: dict) -> list[str]:
    """What STP's clip did in the tuning runs that logged diagnostics (the clip grid): per run, sigma C / B (the
    per-coordinate noise of the scaled gradient), and between the first and last logged rounds the fraction
    clipped, the median scaled norm over C and the smallest scale, with the run's val loss. The reading after the
    numbers is printed only when they show it."""
    batch = float(s["batch_size"])
    parts, quiet, loud, norms, bound = [], [], [], [], None
    for r in sorted(
        tuning, key=lambda r: (get(r.config, "privacy.clip"), get(r.config, "optimizer.eps_s1") or 0)
    ):
        if get(r.config, "optimizer.name") != "stp":
            continue
        logged = [
            m for m in r.metrics() if all(m.get(k) is not None for k in (*_STP_KEYS, "diag/stp_scale_min"))
        ]
        if len(logged) < 2:
            continue
        a, z = logged[0], logged[-1]
        clip, sigma = float(get(r.config, "privacy.clip")), float(get(r.config, "privacy.sigma"))
        noise = sigma * clip / batch
        bound = batch / sigma
        if noise < 1:
            quiet.append(z["diag/frac_clipped"] == 1.0)
            norms.append(z["diag/norm_over_clip_median"] * clip)
        else:
            loud.append(z["diag/stp_scale_min"] < a["diag/stp_scale_min"] / 100)
        parts.append(
            f"C = {clip:g}, eps_s1 = {float(get(r.config, 'optimizer.eps_s1')):g} (sigma C / B = {noise:.3g}; "
            f"rounds {a['step']} -> {z['step']}): fraction clipped {_span(a, z, 'diag/frac_clipped', '.2f')}, "
            f"median scaled norm {_span(a, z, 'diag/norm_over_clip_median', '.3g')} C, smallest scale "
            f"{_span(a, z, 'diag/stp_scale_min', '.3g')}, val loss {float(r.summary['metrics']['test_loss']):.3f}"
        )
    if not parts:
        return []
    text = (
        "STP's clip grid in the tuning runs (results/ganesh_fig3_tuning.md; their diagnostics): "
        + "; ".join(parts)
    )
    if quiet and loud and all(quiet) and all(loud):
        text += (
            ". With sigma C / B < 1 every scaled gradient stays clipped and the scale stays near 1 / eps_s1; with "
            "sigma C / B > 1 the noise of the scaled gradient feeds v^, which grows, so the scale falls by orders "
            "of magnitude and the preconditioner follows the noise. Unclipped scaled gradients need C above their "
            f"norms ({min(norms):.3g} to {max(norms):.3g} at the last logged round of the runs with sigma C / B "
            f"< 1), and sigma C / B < 1 needs C < B / sigma = {bound:.4g}: no clip does both at the eps_s1 tried "
            "(a larger eps_s1 shrinks the scaled norms only by making the scale uniform, i.e. STP becomes "
            "post-processing DP-Adam)"
        )
    return [text + "."]


def _span(a: dict, z: dict, key: str, fmt: str) -> str:
    return f"{format(a[key], fmt)} -> {format(z[key], fmt)}"


# --- re-stating the committed table (dp_adam_bench/report/restate_md.py) ----------------------------------
def restated_sections(frame: pd.DataFrame, md: Markdown, results: Path) -> list[tuple[str, str]]:
    """The md's sections with those of the table's cells recomputed, and the differences from the paper read
    again from the re-stated claims, the kept effective-step reading and the horizon study's table beside it."""
    gaps = ganesh_horizon.gaps_in(results)
    return replaced(
        md.sections,
        {
            DIFFERS: lambda _, old: (
                DIFFERS,
                differs_section(claims_from_frame(frame), step_paragraph(old), *gaps),
            ),
            PAPER_TABLE.split(" (")[0]: lambda *_: (PAPER_TABLE, paper_table(frame)),
            SEED_NOISE: lambda *_: (SEED_NOISE, seed_section(frame)),
        },
    )


def restated_claims(frame: pd.DataFrame, md: Markdown, results: Path) -> list[Claim]:
    del md, results
    return claims_from_frame(frame)


def restated_notes(old: list[str], claims: list[Claim], md: Markdown) -> list[str]:
    del md
    return restated_rule_notes(old, ours_claims(claims), (), WHAT)


SPREADS = {"ours_std": (STD, "population")}
register_reading_md(
    MdRestatement(
        TABLE_ID, SPREADS, restated_claims, restated_notes, restated_sections, digits=3, text=("n",)
    )
)
