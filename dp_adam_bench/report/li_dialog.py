"""Li, Tramer, Liang & Hashimoto (ICLR 2022, arXiv:2110.05679), table "Dataset: Persona-Chat": GPT-2 fine-tuned
with DP-Adam on chit-chat dialog, F1 (higher is better) and perplexity (lower) at eps = 3, eps = 8, non-private.

Reads ``runs/li_dialog_<profile>`` (preset ``configs/experiment/li_dialog.yaml``): one cell per (starting point,
privacy column) over seeds, beside the paper's GPT-2 row (``configs/paper/li.yaml``, dialog), and each private
run's epsilon under every accountant beside the table's. Claims, each with Welch's t-test of its seeds
(:mod:`dp_adam_bench.report.stats`): non-private > eps = 8 > eps = 3 on F1 and the reverse on perplexity (the
paper's rows), and pretrained > from scratch (the CPU profile's control: Li et al.'s "pretrained models fine-tune
well privately"); "the gap to non-private is small" against the paper's own relative gap (:func:`gap_claims`). The
paper's other rows (GPT-2-medium, DialoGPT-medium, the HuggingFace baselines) are listed as not run, with why.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from dp_adam_bench.report import stats
from dp_adam_bench.report.aggregate import get
from dp_adam_bench.report.common import Claim, incomplete_note, load_paper
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.li_e2e import cells_by, epsilon_rows, init_of, lr_schedule_words, metric_rows
from dp_adam_bench.report.paper_rows import NOT_RUN_TITLE, NotRun, fmt, larger_is_better, section
from dp_adam_bench.report.restate import Restatement, register
from dp_adam_bench.report.skeleton import (
    Ordering,
    SeedStats,
    Table,
    complete_runs,
    gap,
    ordering_claims,
    restated_rule_notes,
    rule_notes,
)
from dp_adam_bench.report.stats import STD_SUFFIX

TABLE_ID = "li_dialog"
TITLE = "Li et al. — GPT-2 on Persona-Chat: F1 and perplexity at eps = 3, 8 and non-private"
STD = f"ours{STD_SUFFIX}"
COLUMNS = ("eps3", "eps8", "nonprivate")
INITS = ("pretrained", "scratch")
METRICS = {"f1": "test_f1", "perplexity": "test_perplexity"}
LOWER_IS_BETTER = {"perplexity"}
PAPER_MODEL = "gpt2"
WHAT = "the privacy levels and starting points"


def build(ctx: ReportContext | None = None) -> list[Path]:
    ctx = ctx or ReportContext()
    paper = load_paper("li")["dialog"]
    command = f"make reproduce-table TABLE={TABLE_ID} PROFILE={ctx.profile}"
    found = complete_runs(ctx, TABLE_ID, command)
    by_cell = cells_by(found.complete, init_of)
    frame = pd.DataFrame(_metric_rows(by_cell, paper) + _privacy_rows(by_cell, paper))
    frame["ours_minus_paper"] = frame["ours"] - frame["paper"]
    frame["n"] = frame["n"].astype("Int64")
    claims = claims_from_frame(frame, paper)
    return Table(
        TABLE_ID,
        TITLE,
        command,
        frame,
        setting=_setting(found.complete, ctx.profile),
        claims=claims,
        notes=rule_notes(claims, WHAT) + _notes(found, ctx.profile) + _larger_note(paper),
        digits=3,
        missing=found.missing,
        extra_sections=[(NOT_RUN_TITLE, section(not_run_rows(paper), list(METRIC_HEADERS.values())))],
    ).write(ctx.out)


#: the paper's rows other than GPT-2 (configs/paper/li.yaml dialog.metrics) as the table prints them, and why
#: none is run here
OTHER_ROWS = {
    "gpt2_medium": (
        "GPT-2-medium (355M)",
        "the presets fine-tune GPT-2 (124M): task.model=gpt2-medium (a folder or the hub) on the paper profile",
    ),
    "dialogpt_medium": (
        "DialoGPT-medium",
        "the presets fine-tune GPT-2 (124M): task.model=microsoft/DialoGPT-medium (a folder or the hub) on the "
        "paper profile",
    ),
    "huggingface_convai2_winner": (
        "HuggingFace (ConvAI2 winner)",
        "a non-private baseline the paper quotes (the ConvAI2 winning entry), not a run of its method",
    ),
    "huggingface_our_implementation": (
        "HuggingFace (our implementation)",
        "a non-private baseline the paper's authors re-implemented, not a run of DP-Adam",
    ),
}
METRIC_HEADERS = {"f1": "F1", "perplexity": "perplexity"}


def not_run_rows(paper: dict) -> list[NotRun]:
    """Every (row, column) of the paper's Persona-Chat table other than GPT-2's, which is beside ours above."""
    rows = []
    for col, by_row in paper["metrics"].items():
        for key, values in by_row.items():
            if key == PAPER_MODEL:
                continue
            name, why = OTHER_ROWS.get(key, (key, "not in the presets"))
            rows.append(
                NotRun(name, col, {METRIC_HEADERS[m]: fmt(values.get(m)) for m in METRIC_HEADERS}, why)
            )
    return rows


def _larger_note(paper: dict) -> list[str]:
    """Li et al.'s "larger models do better" (GPT-2-medium over GPT-2), read off the paper's own numbers."""
    ahead, compared, against = larger_is_better(
        [(PAPER_MODEL, "gpt2_medium")],
        paper["metrics"],
        list(METRIC_HEADERS),
        lower_is_better=("perplexity",),
    )
    if not compared:
        return []
    note = (
        "Claim 'larger models do better' (GPT-2-medium over GPT-2): not checked by these runs, which fine-tune one "
        f"model size. In the paper's own numbers GPT-2-medium is ahead in {ahead} of {compared} cells (F1 higher, "
        "perplexity lower)"
    )
    return [note + (f" (not in: {'; '.join(against)})." if against else ".")]


def _metric_rows(by_cell: dict, paper: dict) -> list[dict]:
    def published(init: str, metric: str, col: str):
        return paper["metrics"][col][PAPER_MODEL][metric] if init == "pretrained" else None

    return metric_rows(by_cell, INITS, "init", METRICS, published)


def _privacy_rows(by_cell: dict, paper: dict) -> list[dict]:
    def published(col: str, acc: str):
        return paper["accounting"][col].get(acc)

    return [row for init in INITS for row in epsilon_rows(by_cell, init, "init", published)]


def claims_from_frame(frame: pd.DataFrame, paper: dict) -> list[Claim]:
    """The orderings on the table's F1 and perplexity cells (its CSV holds everything they read)."""
    out = []
    pm = paper["metrics"]
    for metric in METRICS:
        cells = {
            (row["init"], row["column"]): SeedStats.from_row(row, std=STD)
            for row in frame.to_dict("records")
            if row["quantity"] == metric and row["n"]
        }
        lower = metric in LOWER_IS_BETTER
        word = "<" if lower else ">"

        def printed(col: str, m: str = metric) -> str:
            return f"{pm[col][PAPER_MODEL][m]:g}"

        orderings = [
            Ordering(
                ("pretrained", "nonprivate"),
                ("pretrained", "eps8"),
                f"{metric}: non-private {word} eps = 8",
                paper=f"{printed('nonprivate')} vs {printed('eps8')} (GPT-2)",
                lower_is_better=lower,
            ),
            Ordering(
                ("pretrained", "eps8"),
                ("pretrained", "eps3"),
                f"{metric}: eps = 8 {word} eps = 3",
                paper=f"{printed('eps8')} vs {printed('eps3')} (GPT-2)",
                lower_is_better=lower,
            ),
        ]
        orderings += [
            Ordering(
                ("pretrained", col),
                ("scratch", col),
                f"{metric}, {col}: pretrained {word} from scratch",
                lower_is_better=lower,
            )
            for col in COLUMNS
        ]
        out += ordering_claims(orderings, cells)
        out += gap_claims(metric, cells, pm)
    return out


def gap_claims(metric: str, cells: dict, pm: dict) -> list[Claim]:
    """Li et al.'s "the gap to non-private is small", made exact with the paper's own GPT-2 numbers: at each
    epsilon, the pretrained model's private cell is no further from its non-private cell, relative to it, than the
    paper's (F1: (non-private - private) / non-private; perplexity: (private - non-private) / non-private). The test
    is Welch's of the private cell against the non-private cell scaled by (1 - the paper's gap) (F1) or (1 + it)
    (perplexity), its mean and spread alike: the relative gap is linear in the private cell."""
    lower = metric in LOWER_IS_BETTER
    np_cell = cells.get(("pretrained", "nonprivate"))
    out = []
    for col in ("eps3", "eps8"):
        private = cells.get(("pretrained", col))
        if np_cell is None or private is None or not (np_cell.mean > 0 and math.isfinite(np_cell.mean)):
            continue  # no relative gap to a non-private cell that scored nothing (a smoke's 2 steps)
        sign = 1.0 if lower else -1.0
        ours = sign * (private.mean - np_cell.mean) / np_cell.mean
        theirs = sign * (pm[col][PAPER_MODEL][metric] - pm["nonprivate"][PAPER_MODEL][metric])
        theirs /= pm["nonprivate"][PAPER_MODEL][metric]
        k = 1.0 + sign * theirs  # the private cell's bound, as a multiple of the non-private cell
        bound = SeedStats(k * np_cell.mean, None if np_cell.std is None else k * np_cell.std, np_cell.n)
        g = gap(bound, private) if lower else gap(private, bound)  # > 0: within the paper's gap
        parts = [
            f"ours {100 * ours:+.1f} % ({private.mean:.3g} vs {np_cell.mean:.3g}), paper {100 * theirs:+.1f} % "
            f"({pm[col][PAPER_MODEL][metric]:g} vs {pm['nonprivate'][PAPER_MODEL][metric]:g}, GPT-2)",
            f"private - {k:.3f} x non-private = {sign * -g.diff:+.3g}: {g.test()}",
            *([g.flag()] if g.flag() else []),
        ]
        out.append(
            Claim.compared(
                f"{metric}, {col}: the gap to non-private is no larger, relative to non-private, than the paper's",
                stats.state(g, strict=False),
                "; ".join(parts),
            )
        )
    return out


def _setting(complete, profile: str) -> str:
    if not complete:
        return f"profile {profile}: no complete run"
    # the pretrained runs' data note (the scratch control's says so in its own rows)
    first = next((r for r in complete if init_of(r.config) == "pretrained"), complete[0])
    cfg, s = first.config, first.summary
    return (
        f"profile {profile}: {s.get('data_note', '')}; expected B = {get(cfg, 'train.batch_size')}, "
        f"{s.get('steps')} Poisson steps, C = {get(cfg, 'privacy.clip')}, Adam lr {get(cfg, 'optimizer.lr')} "
        f"{lr_schedule_words(cfg)}, delta = {get(cfg, 'privacy.delta')}, sigma calibrated under RDP to the "
        f"column's epsilon, {get(cfg, 'train.clipping')} clipping, {get(cfg, 'task.max_history')} turns of history, "
        f"greedy decoding. Paper: GPT-2 (124M) on Persona-Chat's validation split."
    )


def _notes(found, profile: str) -> list[str]:
    notes = []
    if profile == "cpu":
        notes.append(
            "CPU profile: STAND-IN DATA (Synthetic-Persona-Chat: Persona-Chat's personas with LLM-written "
            "conversations, not Persona-Chat's text) and the 4-layer GPT-2 li_e2e pretrains on arXiv abstracts "
            "instead of GPT-2 (124M) pretrained on WebText: compare the orderings, not the scores. The perplexity "
            "is over the compact vocabulary's tokens, not GPT-2's."
        )
    notes.append(
        "The paper's epsilon columns are for its own N, batch size and epochs, which it does not print: they are "
        "shown, not re-derived here (results/li_dialog_accounting.md solves the schedule they imply and tests "
        "it). GDP + CLT is an approximation, not a bound."
    )
    return notes + incomplete_note(found.incomplete)


register(
    Restatement(
        TABLE_ID,
        {},
        claims=lambda frame: claims_from_frame(frame, load_paper("li")["dialog"]),
        notes=lambda old, claims: restated_rule_notes(old, claims, (), WHAT),
        digits=3,
    )
)
