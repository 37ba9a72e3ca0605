"""Li, Tramer, Liang & Hashimoto (ICLR 2022, arXiv:2110.05679), table "Dataset: GLUE" on SST-2: full fine-tuning
with the plain classifier ("full") against text infilling ("full + infilling"), at eps = 3, eps = 8 and non-private,
and the methods that train fewer parameters with the classifier (``task.finetune``: LoRA, which the table does not
have, RGP, which it prints at eps = 8, and the head alone on the frozen encoder, a linear-probe baseline the table
does not have either).

Reads ``runs/li_glue_<profile>`` (preset ``configs/experiment/li_glue.yaml``): one cell per (method, privacy
column) over seeds, GLUE dev accuracy and loss beside the paper's RoBERTa-base numbers (``configs/paper/li.yaml``,
glue.metrics), each private run's epsilon under every accountant beside the table's (the exact re-derivation of
those digits is ``results/li_glue_accounting.md``), and each private cell's noise-batch ratio sigma / B beside the
paper's (the quantity Li et al. and McKenna et al. 2025, arXiv:2501.18914, scale on). Where the runs train the top
of the encoder on cached frozen layers (the CPU profile, ``task.cache_frozen_prefix``) the rows are named for what
trains (top1, top1 + infilling, LoRA on top1, the head on the frozen encoder), in the column ``row``.

Claims, each judged by Welch's t-test of its seeds (:mod:`dp_adam_bench.report.stats`): infilling beats the
classifier at the same epsilon (the paper's claim), RGP beats full fine-tuning at eps = 8 (the paper's numbers),
full fine-tuning beats the head alone (the paper's thesis that full fine-tuning's dimension does not hurt it), and
each method's non-private > eps = 8 > eps = 3 (the paper's own numbers do not order full's eps = 3 and 8).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from dp_adam_bench.report.aggregate import get
from dp_adam_bench.report.common import Claim, incomplete_note, load_paper
from dp_adam_bench.report.context import ReportContext
from dp_adam_bench.report.li_e2e import cells_by, column_of, epsilon_rows, lr_schedule_words, metric_rows
from dp_adam_bench.report.li_hyperparams import noise_over_clip
from dp_adam_bench.report.paper_rows import NOT_RUN_TITLE, NotRun, fmt, larger_is_better, section
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
from dp_adam_bench.report.stats import STD_SUFFIX

TABLE_ID = "li_glue"
TITLE = "Li et al. — SST-2 (GLUE dev): full fine-tuning, classifier against text infilling, at eps = 3, 8, non-private"
STD = f"ours{STD_SUFFIX}"
COLUMNS = ("eps3", "eps8", "nonprivate")
#: the table's rows: the objective with every parameter trained, then the methods that train fewer (classifier)
METHODS = {
    "classifier": "full",
    "infilling": "full + infilling",
    "lora": "LoRA",
    "rgp": "RGP",
    "head": "head (pooler + classifier)",
}
PAPER_ROWS = {
    "classifier": "full_roberta_base",
    "infilling": "infilling_roberta_base",
    "rgp": "rgp_roberta_base",
}
METRICS = {"accuracy": "test_accuracy", "loss": "test_loss"}
#: the quantity of the noise-batch ratio rows
SIGMA_OVER_B = "noise-batch ratio sigma / B"
TASK = "SST-2"
#: GLUE SST-2 dev has 444 positive and 428 negative sentences: the accuracy of predicting one class throughout
MAJORITY = 100.0 * 444 / 872
#: the cross-entropy of predicting each class with probability 1 / 2
LN2 = math.log(2.0)
LOSS_MARGIN = 0.01
WHAT = "the objectives and privacy levels"


def build(ctx: ReportContext | None = None) -> list[Path]:
    ctx = ctx or ReportContext()
    paper = load_paper("li")["glue"]
    command = f"make reproduce-table TABLE={TABLE_ID} PROFILE={ctx.profile}"
    found = complete_runs(ctx, TABLE_ID, command)
    by_cell = cells_by(found.complete, method_of)
    # the rows this profile runs (a row the preset does not run, e.g. LoRA and RGP on the CPU, is not printed empty:
    # the notes say why, and the paper's number stays in the section of rows not run here)
    ran = {g for g, _ in by_cell} | {method_of(r.config) for r in found.incomplete}
    methods = {m: name for m, name in METHODS.items() if m in ran} | {
        g: g for g in sorted(ran - set(METHODS))
    }
    names = row_names(found.complete)
    frame = pd.DataFrame(
        _metric_rows(by_cell, paper, methods)
        + _privacy_rows(by_cell, paper, methods)
        + _noise_batch_rows(by_cell, paper, methods)
    )
    frame.insert(2, "row", frame["method"].map(lambda m: names.get(m, METHODS.get(m, m))))
    frame["ours_minus_paper"] = frame["ours"] - frame["paper"]
    frame["n"] = frame["n"].astype("Int64")
    claims = claims_from_frame(frame, paper)
    notes = rule_notes(claims, WHAT) + _majority_note(frame) + _noise_note(by_cell, names)
    notes += (
        _start_note(by_cell, names)
        + _infilling_note(frame, by_cell, paper)
        + _nonprivate_below_note(frame, by_cell)
    )
    notes += _lr_note(by_cell, names) + _notes(found, ctx.profile) + _unchecked_claim_notes(paper)
    return Table(
        TABLE_ID,
        TITLE,
        command,
        frame,
        setting=_setting(found.complete, ctx.profile),
        claims=claims,
        notes=notes,
        digits=3,
        missing=found.missing,
        extra_sections=[(NOT_RUN_TITLE, section(not_run_rows(paper, ran), list(HEADERS.values())))],
    ).write(ctx.out)


#: the tasks of the paper's table, in its order; MNLI as matched / mismatched
GLUE_TASKS = ("MNLI", "QQP", "QNLI", "SST-2")
HEADERS = {"MNLI": "MNLI (m / mm)", "QQP": "QQP", "QNLI": "QNLI", "SST-2": "SST-2"}
#: the paper's row prefixes (configs/paper/li.yaml glue.metrics) as the table prints them
PAPER_METHODS = {"full": "full", "infilling": "full + infilling", "rgp": "RGP"}
PAPER_SIZES = {"roberta_base": "RoBERTa-base", "roberta_large": "RoBERTa-large"}


def not_run_rows(paper: dict, ran: set[str] | None = None) -> list[NotRun]:
    """Every (row, column) of the paper's GLUE table with a number this table does not have beside ours: MNLI,
    QQP and QNLI (their data is not offline), RoBERTa-large (in no preset), and SST-2 for a row these runs do not
    have (``ran``: the table's methods with runs; None: every row)."""
    rows = []
    ours = {method for method, key in PAPER_ROWS.items() if ran is None or method in ran}
    for col, by_row in paper["metrics"].items():
        for key, values in by_row.items():
            method, size = key.split("_", 1)
            name = f"{PAPER_METHODS.get(method, method)} ({PAPER_SIZES.get(size, size)})"
            cells = {HEADERS[t]: fmt(values.get(t)) for t in GLUE_TASKS}
            if size == "roberta_base" and any(PAPER_ROWS[m] == key for m in ours):
                cells[HEADERS["SST-2"]] = "beside ours above"
                why = (
                    "MNLI, QQP and QNLI are not offline here: task.glue (mnli, qqp or qnli) with task.data_dir (a "
                    "folder of GLUE's TSVs) runs them on either profile"
                )
            elif size == "roberta_base":
                why = (
                    f"this profile does not run {PAPER_METHODS.get(method, method)} (the notes say why); the paper "
                    "profile does (and GLUE's TSVs in task.data_dir for MNLI, QQP and QNLI)"
                )
            else:
                why = (
                    "RoBERTa-large is in no preset: task.model=roberta-large on the paper profile (and GLUE's TSVs "
                    "in task.data_dir for MNLI, QQP and QNLI)"
                )
            rows.append(NotRun(name, col, cells, why))
    return rows


def _unchecked_claim_notes(paper: dict) -> list[str]:
    """The paper's claims these runs cannot check, each said so: "larger models do better" (read off the paper's own
    numbers: no profile here runs two sizes) and "the gap to non-private is small" (no non-private GLUE numbers)."""
    pairs = [(f"{m}_roberta_base", f"{m}_roberta_large") for m in PAPER_METHODS]
    ahead, compared, against = larger_is_better(pairs, paper["metrics"], GLUE_TASKS)
    if not compared:
        return []
    note = (
        f"Claim 'larger models do better' (RoBERTa-large over -base): not checked by these runs, which use one "
        f"model size per profile. In the paper's own numbers RoBERTa-large is ahead in {ahead} of {compared} cells"
    )
    gap = (
        "Claim 'the gap to non-private is small': not checked against the paper, whose GLUE table prints no "
        "non-private accuracy; the non-private > eps = 8 orderings above are between our own cells."
    )
    return [note + (f" (not in: {'; '.join(against)})." if against else "."), gap]


def method_of(cfg) -> str:
    """A run's row: its objective when every parameter trains (``task.finetune`` null or full), else the
    fine-tuning method (with ``+infilling`` when it reads the label words)."""
    objective = str(get(cfg, "task.objective") or "classifier")
    finetune = get(cfg, "task.finetune")
    if finetune in (None, "full"):
        return objective
    return str(finetune) if objective == "classifier" else f"{finetune}+{objective}"


def row_names(complete) -> dict[str, str]:
    """The printed name of each row whose runs train the top of the encoder on cached frozen layers
    (``task.cache_frozen_prefix``): top<k> for full fine-tuning's objectives, LoRA / RGP on that top, the head on
    the frozen encoder (its pooling said); rows of runs over every layer keep :data:`METHODS`' names."""
    names = {}
    for r in complete:
        if not get(r.config, "task.cache_frozen_prefix"):
            continue
        method, k = method_of(r.config), get(r.config, "task.trained_blocks")
        k = 1 if k is None else int(k)
        mean = get(r.config, "task.pooling") == "mean"
        if method == "head" or k == 0:
            name = (
                "head (frozen encoder: linear on the mean-pooled embedding)"
                if mean
                else "head (pooler + classifier, the encoder frozen)"
            )
        elif method == "classifier":
            name = f"top{k}"
        elif method == "infilling":
            name = f"top{k} + infilling"
        else:
            name = f"{METHODS.get(method, method)} (top{k})"
        names[method] = name
    return names


def _names(frame: pd.DataFrame) -> dict[str, str]:
    """Row key -> printed name, from the frame's ``row`` column (:func:`row_names`); :data:`METHODS` otherwise."""
    out = dict(METHODS)
    if "row" in frame:
        out.update({m: r for m, r in zip(frame["method"], frame["row"], strict=True) if isinstance(r, str)})
    return out


def _published(paper: dict, method: str, col: str):
    return (paper["metrics"].get(col) or {}).get(PAPER_ROWS.get(method, ""), {}).get(TASK)


def _metric_rows(by_cell: dict, paper: dict, methods: dict) -> list[dict]:
    def published(method: str, metric: str, col: str):
        return _published(paper, method, col) if metric == "accuracy" else None

    return metric_rows(by_cell, methods, "method", METRICS, published)


def _privacy_rows(by_cell: dict, paper: dict, methods: dict) -> list[dict]:
    def published(col: str, acc: str):
        value = paper["accounting"][col].get(acc)
        return value.get(TASK) if isinstance(value, dict) else value

    return [
        row
        for method in methods
        if any(g == method for g, _ in by_cell)
        for row in epsilon_rows(by_cell, method, "method", published)
    ]


def paper_sigma(paper: dict, col: str) -> float:
    """The paper's sigma for SST-2 at a column's epsilon: calibrated under RDP from its N, B and epochs, as
    :mod:`~dp_adam_bench.report.li_glue_accounting` re-derives the table's epsilons."""
    from dp_adam_bench.privacy.accounting import calibrate_sigma
    from dp_adam_bench.report.li_glue_accounting import CALIBRATION_TOL, paper_setting

    delta, q, steps = paper_setting(paper["tasks"][TASK])
    return calibrate_sigma(
        float(paper["accounting"][col]["rdp"]), delta, q, steps, "rdp", tol=CALIBRATION_TOL
    )


def _noise_batch_rows(by_cell: dict, paper: dict, methods: dict) -> list[dict]:
    """Per private cell, sigma / B (the noise in the averaged update, in units of the clip: sigma C / B over C) from
    the runs' own sigma and expected batch, beside the paper's (its sigma over its B = 1000)."""
    rows = []
    batch = float(paper["tasks"][TASK]["batch_size"])
    for method in methods:
        if not any(g == method for g, _ in by_cell):
            continue
        for col in ("eps3", "eps8"):
            vals = [
                float(r.summary["sigma"]) / float(get(r.config, "train.batch_size"))
                for r in by_cell.get((method, col), [])
                if r.summary.get("sigma") and get(r.config, "train.batch_size")
            ]
            rows.append(
                {
                    "quantity": SIGMA_OVER_B,
                    "method": method,
                    "column": col,
                    "paper": paper_sigma(paper, col) / batch,
                    "ours": float(np.mean(vals)) if vals else None,
                    STD: None,
                    "n": len(vals),
                }
            )
    return rows


def claims_from_frame(frame: pd.DataFrame, paper: dict) -> list[Claim]:
    """The orderings on the table's accuracy cells (its CSV holds everything they read)."""
    cells = {
        (row["method"], row["column"]): SeedStats.from_row(row, std=STD)
        for row in frame.to_dict("records")
        if row["quantity"] == "accuracy" and row["n"]
    }
    ran = {method for method, _ in cells}
    names = _names(frame)
    full = names["classifier"]
    # the paper's wording where every layer trains; the rows' own names where a top on cached layers does
    full_ft = "full fine-tuning" if full == METHODS["classifier"] else f"{full} fine-tuning"
    head = names["head"].removeprefix("head (").removesuffix(")")
    if names["head"] == METHODS["head"]:
        head += ", the encoder frozen"

    def printed(method: str, col: str) -> str:
        value = _published(paper, method, col)
        return "-" if value is None else f"{value:g}"

    orderings = [
        Ordering(
            ("infilling", col),
            ("classifier", col),
            f"{col}: {names['infilling']} beats {full} (the plain classifier) on SST-2 accuracy",
            paper=f"{printed('infilling', col)} vs {printed('classifier', col)} (RoBERTa-base)",
        )
        for col in ("eps3", "eps8")
    ]
    if "rgp" in ran:
        orderings.append(
            Ordering(
                ("rgp", "eps8"),
                ("classifier", "eps8"),
                f"eps8: RGP beats {full_ft} (both with the plain classifier) on SST-2 accuracy",
                paper=f"{printed('rgp', 'eps8')} vs {printed('classifier', 'eps8')} (RoBERTa-base)",
            )
        )
    if "head" in ran:
        orderings += [
            Ordering(
                ("classifier", col),
                ("head", col),
                f"{col}: {full_ft} beats training the head alone ({head})",
                paper=f"{printed('classifier', col)} (full); the table has no head row: Li et al.'s thesis that "
                "full fine-tuning's dimension does not hurt it",
            )
            for col in ("eps3", "eps8")
        ]
    for objective in METHODS:
        name = names[objective]
        if objective not in ran:
            continue
        orderings += [
            Ordering(
                (objective, "nonprivate"),
                (objective, "eps8"),
                f"{name}: non-private > eps = 8 (accuracy)",
                paper=f"non-private not in the table; eps = 8 {printed(objective, 'eps8')}",
            ),
            Ordering(
                (objective, "eps8"),
                (objective, "eps3"),
                f"{name}: eps = 8 > eps = 3 (accuracy)",
                paper=f"{printed(objective, 'eps8')} vs {printed(objective, 'eps3')}",
            ),
        ]
    return ordering_claims(orderings, cells, unit="%")


def _majority_note(frame: pd.DataFrame) -> list[str]:
    """The cells whose every seed scored the majority-class rate: models that predict one class for every
    sentence (read from the cells' mean and spread)."""
    names = _names(frame)
    acc = frame[(frame.quantity == "accuracy") & (frame.n > 0)]
    flat = acc[((acc.ours - MAJORITY).abs() < 1e-6) & (acc[STD].fillna(0.0) < 1e-6)]
    if flat.empty:
        return []
    cells = ", ".join(f"{names.get(r.method, r.method)} {r.column}" for r in flat.itertuples())
    note = (
        f"At the majority-class rate ({MAJORITY:.2f} %, 444 of 872 dev sentences are positive) on every seed: "
        f"{cells}. These models predict one class for every sentence: at this budget they have not learned the "
        "task, so their orderings say nothing about the objectives."
    )
    worse = [r for r in flat.itertuples() if _loss(frame, r.method, r.column) > LN2 + LOSS_MARGIN]
    if worse:
        cells_loss = ", ".join(
            f"{names.get(r.method, r.method)} {r.column} ({_loss(frame, r.method, r.column):.3f})"
            for r in worse
        )
        note += (
            f" Of these, the dev loss is above ln 2 = {LN2:.3f} (by more than {LOSS_MARGIN:g}), the loss of "
            f"predicting 50 / 50 for every sentence, at {cells_loss}: the noise moved those models to "
            "confident answers, not just left them untrained."
        )
    flat_np = [r.method for r in flat.itertuples() if r.column == "nonprivate"]
    if flat_np:
        rows = ", ".join(names.get(m, m) for m in flat_np)
        note += (
            f" {rows} stays there without noise too: its private cells fail for lack of steps at this learning "
            "rate, not for the noise."
        )
    return [note]


def _loss(frame: pd.DataFrame, method: str, column: str) -> float:
    """The cell's mean dev loss (NaN where the table has none)."""
    row = frame[(frame.quantity == "loss") & (frame.method == method) & (frame.column == column)]
    return float(row["ours"].iloc[0]) if len(row) else float("nan")


def _noise_note(by_cell: dict, names: dict | None = None) -> list[str]:
    """Per private cell, the norm of the noise in the averaged update against the clipped mean gradient's, from the
    runs' own sigma, expected batch B and trainable count d: ||z|| = sigma C sqrt(d) / B, while the average of
    per-example gradients clipped to C has norm at most C (Li et al.'s gradient-SNR, read as an upper bound)."""
    names = {**METHODS, **(names or {})}
    parts = []
    for (method, col), runs in sorted(by_cell.items()):
        if col == "nonprivate":
            continue
        ratios, dims = [], set()
        for r in runs:
            if (noise := _run_noise(r)) is not None:
                ratios.append(noise[0])
                dims.add(noise[1])
        if ratios:
            d = " / ".join(f"{x:,}" for x in sorted(dims))
            parts.append(f"{names.get(method, method)} {col} (d = {d}): {np.mean(ratios):.3g}")
    if not parts:
        return []
    note = (
        "Noise against signal, from the runs' own sigma, B and trainable count d: ||z|| / C = sigma sqrt(d) / B, "
        "the norm of the noise in the averaged update over the largest norm the averaged clipped gradient can have "
        f"(C): {'; '.join(parts)}. Above 1 the update is mostly noise at every step."
    )
    measured = [
        f"{names.get(method, method)} {col}: ||g|| / C {m[0]:.3g}, so ||g|| / ||z|| {m[1]:.3g}; "
        + (
            f"median v private / clean {m[2]:.3g}"
            if math.isfinite(m[2])
            else "the median coordinate's clean v is 0 (no clean gradient reaches it, the noise does)"
        )
        for (method, col), runs in sorted(by_cell.items())
        if col != "nonprivate" and (m := _measured(runs)) is not None
    ]
    if measured:
        note += (
            " Below 1 is not enough: the averaged clipped gradient g is shorter than C when examples disagree, and "
            "Adam divides each coordinate by its running second moment v, which the noise inflates by (sigma C / "
            "B)^2 (the bias DP-AdamBC subtracts; Tang & Lecuyer 2023, arXiv:2304.11208), so a coordinate whose clean v "
            "is below that moves by a sizeable fraction of the lr each step, at random. Measured where the runs log "
            "clean-gradient diagnostics (diagnostic: never released; medians over the logged steps and seeds): "
            f"{'; '.join(measured)}."
        )
    return [note]


def _run_noise(r) -> tuple[float, int] | None:
    """(||z|| / C, d) of a run from its own sigma, expected batch and trainable count; None where one is missing."""
    d = (r.summary.get("finetune") or {}).get("trainable_params")
    sigma, b = r.summary.get("sigma"), get(r.config, "train.batch_size")
    return (noise_over_clip(sigma, d, b), int(d)) if d and sigma and b else None


def _measured(runs) -> tuple[float, float, float] | None:
    """(||g|| / C, ||g|| / ||z||, median private v / median clean v) from the runs' clean-gradient diagnostics
    (``diagnostics.every``): medians over every logged step of every seed; None where none is logged."""
    g_over_c, snr, v_ratio = [], [], []
    for r in runs:
        if (noise := _run_noise(r)) is None:
            continue
        for m in r.metrics():
            g = m.get("diag/grad_norm_over_clip")
            if g is None:
                continue
            g_over_c.append(float(g))
            snr.append(float(g) / noise[0])
            vp, vc = m.get("diag/v_private_median"), m.get("diag/v_clean_median")
            if vp is not None and vc:
                v_ratio.append(float(vp) / float(vc))
    if not g_over_c:
        return None
    return (
        float(np.median(g_over_c)),
        float(np.median(snr)),
        float(np.median(v_ratio)) if v_ratio else float("nan"),
    )


def _start_note(by_cell: dict, names: dict | None = None) -> list[str]:
    """Dev accuracy of the untrained models (step 0, logged with ``train.eval_at_start``), per method: what the
    pretrained checkpoint brings before any step (for infilling, the label words' prior)."""
    at_start: dict[str, list[float]] = {}
    for (method, _), runs in by_cell.items():
        for r in runs:
            first = next((m for m in r.metrics() if m.get("step") == 0 and "test_accuracy" in m), None)
            if first is not None:
                at_start.setdefault(method, []).append(float(first["test_accuracy"]))
    if not at_start:
        return []
    label = {**METHODS, **(names or {})}
    parts = [
        f"{label.get(m, m)} {np.mean(v):.2f} % ({len(v)} runs)"
        for m, v in sorted(
            at_start.items(), key=lambda kv: list(METHODS).index(kv[0]) if kv[0] in METHODS else 99
        )
    ]
    return [f"Dev accuracy before training (step 0, train.eval_at_start): {'; '.join(parts)}."]


def _infilling_note(frame: pd.DataFrame, by_cell: dict, paper: dict) -> list[str]:
    """Where infilling scores below the plain classifier at a private column (the paper's claim the other way), why,
    from the table's own numbers: the untrained infilling model's dev accuracy (its label words' prior, step 0)
    against the majority-class rate. The paper's edge for infilling is its pretrained masked-LM head reading the
    label words (LM-BFF; Gao et al. 2021, arXiv:2012.15723): a model that starts at the majority class has none."""
    names = _names(frame)
    acc = frame[(frame.quantity == "accuracy") & (frame.n > 0)].set_index(["method", "column"])["ours"]
    below = [
        f"{col} {acc[('infilling', col)]:.2f} vs {acc[('classifier', col)]:.2f} (paper "
        f"{_published(paper, 'infilling', col):g} vs {_published(paper, 'classifier', col):g})"
        for col in ("eps3", "eps8")
        if ("infilling", col) in acc
        and ("classifier", col) in acc
        and acc[("infilling", col)] < acc[("classifier", col)]
        and _published(paper, "infilling", col) is not None
    ]
    start = [
        float(m["test_accuracy"])
        for (method, _), runs in by_cell.items()
        if method == "infilling"
        for r in runs
        for m in r.metrics()
        if m.get("step") == 0 and "test_accuracy" in m
    ]
    if not below or not start:
        return []
    at_start = float(np.mean(start))
    prior = (
        "the majority-class rate: it predicts the same label word for every sentence"
        if abs(at_start - MAJORITY) < 1e-6
        else f"against the majority class's {MAJORITY:.2f} %"
    )
    return [
        f"{names['infilling']} scores below {names['classifier']} at {'; '.join(below)}. In the paper infilling's "
        "edge comes from RoBERTa's pretrained masked-LM head, whose label words separate the classes before any "
        f"step; here the untrained infilling model scores {at_start:.2f} % at step 0 ({prior}; MiniLM ships "
        "without a masked-LM head and the one fitted here is fitted on arXiv abstracts), so infilling starts "
        "with no prior to exploit."
    ]


def _nonprivate_below_note(frame: pd.DataFrame, by_cell: dict) -> list[str]:
    """A row whose non-private cell scores below its eps = 8 cell: both cells' accuracy, dev loss and learning rate
    (each column's lr is chosen on its own pilots, so the columns differ in more than the noise)."""
    names = _names(frame)
    cell = frame[frame.n > 0].set_index(["quantity", "method", "column"])["ours"]
    parts = []
    for method in sorted({m for m, _ in by_cell}):
        keys = [("accuracy", method, "nonprivate"), ("accuracy", method, "eps8")]
        if not all(k in cell for k in keys) or cell[keys[0]] >= cell[keys[1]]:
            continue
        lrs = {
            col: "/".join(
                sorted({f"{float(get(r.config, 'optimizer.lr')):g}" for r in by_cell.get((method, col), [])})
            )
            for col in ("nonprivate", "eps8")
        }
        losses = [cell.get(("loss", method, col), float("nan")) for col in ("nonprivate", "eps8")]
        parts.append(
            f"{names.get(method, method)}: non-private {cell[keys[0]]:.2f} % (dev loss {losses[0]:.3f}, lr "
            f"{lrs['nonprivate']}) against eps = 8's {cell[keys[1]]:.2f} % (dev loss {losses[1]:.3f}, lr {lrs['eps8']})"
        )
    if not parts:
        return []
    return [
        "Non-private below eps = 8: "
        + "; ".join(parts)
        + ". Each column's learning rate is its own pilots' choice on the public split, so the columns differ in "
        "the learning rate as well as the noise (a lower dev loss at a lower accuracy: more confident, not more often "
        "right), and the pilots score on training examples, which in SST-2 include phrases, while dev has whole "
        "sentences only."
    ]


def _setting(complete, profile: str) -> str:
    """The shared setting, read from a private full fine-tuning run where there is one (its population, sampling
    rate and steps: the privacy regime); the data note from an infilling run where there is one (it adds the
    template, the label words and the masked-LM head to the classifier's). The learning rates are per row
    (:func:`_lr_note`)."""
    full = [
        r for r in complete if method_of(r.config) == "classifier" and get(r.config, "noise.kind") != "none"
    ]
    first = (full or complete)[0]
    cfg, plan = first.config, first.summary.get("privacy_plan") or {}
    infilling = [r for r in complete if method_of(r.config) == "infilling"]
    s = (infilling or full or complete)[0].summary
    steps, n, q = s.get("steps"), plan.get("population"), plan.get("sampling_rate")
    regime = f"{steps} Poisson steps"
    if n and q and steps:
        regime += f" (q = {float(q):.4f} of N = {int(n):,}: {float(q) * int(steps):.2f} epochs)"
    sigmas = {
        col: np.mean(
            [
                float(r.summary["sigma"])
                for r in complete
                if column_of(r.config) == col and r.summary.get("sigma")
            ]
        )
        for col in ("eps3", "eps8")
        if any(column_of(r.config) == col and r.summary.get("sigma") for r in complete)
    }
    sigma = ", ".join(f"{c} {v:.3f}" for c, v in sigmas.items())
    return (
        f"profile {profile}: {s.get('data_note', '')}; expected B = {get(cfg, 'train.batch_size')}, {regime}, "
        f"C = {get(cfg, 'privacy.clip')}, Adam {lr_schedule_words(cfg)} (each row's lr: the notes), delta = "
        f"{get(cfg, 'privacy.delta')}, sigma calibrated under RDP to the column's epsilon"
        + (f" ({sigma})" if sigma else "")
        + f", {get(cfg, 'train.clipping')} clipping, max {get(cfg, 'task.max_length')} tokens. Paper: RoBERTa-base "
        "on all 67,349 sentences, B = 1000, 3 epochs (203 steps at q = 0.0148), sigma 0.822 / 0.578."
    )


def _lr_note(by_cell: dict, names: dict) -> list[str]:
    """Each row's learning rate in each column, read from its runs (a cell whose runs disagree lists each), and
    where they were chosen: the public tuning split's pilots when the runs hold one out (task.public_split)."""
    label = {**METHODS, **names}
    parts = []
    for method in [*METHODS, *sorted({m for m, _ in by_cell} - set(METHODS))]:
        lrs = []
        for col in COLUMNS:
            values = sorted({float(get(r.config, "optimizer.lr")) for r in by_cell.get((method, col), [])})
            if values:
                lrs.append(f"{col} {' / '.join(f'{v:g}' for v in values)}")
        if lrs:
            parts.append(f"{label.get(method, method)}: {', '.join(lrs)}")
    if not parts:
        return []
    public = [r for runs in by_cell.values() for r in runs if get(r.config, "task.public_split") is not None]
    size, val = (
        (get(public[0].config, "task.public_split"), get(public[0].config, "task.public_val"))
        if public
        else (0, 0)
    )
    where = (
        f"each the best final accuracy of a grid on a public tuning split ({int(size):,} "
        "training sentences removed from every private run's training set: trained on all but "
        f"{int(val or 1000):,} of them at the private runs' B, steps and sigma, scored "
        "on those; never on dev; results/li_glue_pilots.md, configs/experiment/li_glue_pilots.yaml), so the choice "
        "costs the private runs no privacy, on the assumption that those sentences may be public (every SST-2 "
        "sentence is; on data private throughout, hold out only data you may publish: the epsilon covers the "
        "training set alone)"
        if public
        else "the preset's (configs/experiment/li_glue.yaml says where each comes from)"
    )
    return [f"Learning rates, {where}: {'; '.join(parts)}."]


#: why the CPU profile runs the top block on cached layers: the rows it does not run and what they would cost
FULL_COST = (
    "Not run on the CPU profile: full fine-tuning of every layer (no cached layers), RGP (the paper's eps = 8 row) "
    "and LoRA (not a row of the paper's GLUE table); the paper profile runs all three. A private step of the top "
    "block on cached layers takes ~1.7 to 2 s at B = 1000 on 2 cores (measured: the pilots, one run at a time, "
    "results/li_glue_pilots.md); every layer would run the embeddings and six such blocks forward and backward "
    "at every step (not measured: at least ~6x, over half an hour a run)."
)


def _notes(found, profile: str) -> list[str]:
    cached = [r for r in found.complete if get(r.config, "task.cache_frozen_prefix")]
    notes = []
    if profile == "cpu" and cached:
        notes.append(
            "CPU profile: MiniLM-L6 (22.7M parameters, a sentence-embedding checkpoint) instead of RoBERTa-base "
            "(125M), in the paper's privacy regime (the setting line): what shrinks is what trains. The embeddings "
            "and the encoder layers below the trained top run once per sentence, in eval mode (no dropout there), "
            "and are cached (tasks/frozen_prefix.py); a per-example gradient of the top on them is the full "
            "model's with those layers frozen, so the privacy is the same. top1 trains the last block and a "
            "classifier on the L2-normalised mean of its token states (MiniLM's own sentence embedding; its [CLS] "
            "pooler is missing from the checkpoint); top1 + infilling trains the last block and the masked-LM head "
            "(its transform and the two label words' decoder rows, the only rows the loss reads); the head row is "
            "a linear classifier on the frozen encoder's mean-pooled, L2-normalised embedding. The paper's numbers "
            "beside them are RoBERTa-base's full fine-tuning: compare the orderings, not the accuracies. The "
            "infilling rows read the label words through a masked-LM head that MiniLM lacks, fitted here "
            "non-privately on public arXiv abstracts with the encoder frozen (`dp-adam-bench pretrain "
            "minilm_mlm_head`), where RoBERTa brings the head it was pretrained with."
        )
        notes.append(FULL_COST)
    elif profile == "cpu":
        notes.append(
            "CPU profile: MiniLM-L6 (22.7M parameters, a sentence-embedding checkpoint) instead of RoBERTa-base "
            "(125M): compare the orderings, not the accuracies. The infilling rows read the label words through a "
            "masked-LM head that MiniLM lacks, fitted here non-privately on public arXiv abstracts with the encoder "
            "frozen (`dp-adam-bench pretrain minilm_mlm_head`), where RoBERTa brings the head it was pretrained with."
        )
    notes.append(
        "GDP + CLT is an approximation, not a bound; PRV and PLD are numerical accountants of the same mechanism. "
        "The paper's epsilon columns are for its N, B and epochs (results/li_glue_accounting.md re-derives them); "
        "ours are for the setting line's, the same B and epochs of a training set without the public tuning split "
        "where the runs hold one out. sigma / B is the noise in the averaged update in units of the clip (sigma C / "
        "B over C), the quantity the private results scale with (Li et al. §3; McKenna et al. 2025, "
        "arXiv:2501.18914)."
    )
    return notes + incomplete_note(found.incomplete)


register(
    Restatement(
        TABLE_ID,
        {},
        claims=lambda frame: claims_from_frame(frame, load_paper("li")["glue"]),
        notes=lambda old, claims: restated_rule_notes(old, claims, (), WHAT),
        digits=3,
    )
)
