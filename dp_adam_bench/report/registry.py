"""Table ids -> how each table is built: ``REPORTS``, a :class:`~dp_adam_bench.registry.Registry` of
:class:`ReportSpec`. Adding a table: a build function ``build(ctx, *args)`` and one entry here."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dp_adam_bench.registry import Registry
from dp_adam_bench.report.context import ReportContext


@dataclass(frozen=True)
class ReportSpec:
    """``builder``: ``"module:function"``, called as ``function(ctx, *args)`` with a
    :class:`~dp_adam_bench.report.context.ReportContext`; ``experiment``: the sweep preset whose runs the table
    reads (None: the table is computed exactly, the same at every profile); ``also``: further presets whose runs
    it reads at the profiles in ``also_profiles`` (``reproduce`` sweeps them too; their complete runs are
    reused)."""

    builder: str
    paper: str
    shows: str
    runtime_cpu: str
    experiment: str | None = None
    runtime_paper: str = "same"
    args: tuple = ()
    also: tuple[str, ...] = ()
    also_profiles: tuple[str, ...] = ("cpu", "paper")

    def function(self) -> Callable[..., list[Path]]:
        module, name = self.builder.split(":")
        return getattr(importlib.import_module(module), name)


def _in(module: str, function: str = "build") -> str:
    return f"dp_adam_bench.report.{module}:{function}"


REPORTS = Registry("table", "table")

_TABLES: tuple[tuple[str, ReportSpec], ...] = (
    (
        "ganesh_fig2",
        ReportSpec(
            _in("ganesh_fig2"),
            "Ganesh et al. Fig. 2",
            "1-D logistic regression, private AdaGrad variants",
            "~2 min",
            experiment="ganesh_fig2",
        ),
    ),
    (
        "ganesh_mechanisms",
        ReportSpec(
            _in("ganesh_mechanisms"), "Ganesh et al. §5.2", "RMSE and epsilon of DP-SGD vs DP-BandMF", "~10 s"
        ),
    ),
    (
        "ganesh_quadratic",
        ReportSpec(
            _in("ganesh_quadratic"),
            "Ganesh et al. §4.1-4.3",
            "per-coordinate learning rates vs non-private 1/c on a 2-D quadratic",
            "~1 min",
            experiment="ganesh_quadratic",
        ),
    ),
    (
        "li_e2e_accounting",
        ReportSpec(
            _in("li_e2e_accounting"),
            "Li et al. (E2E)",
            "sigma calibrated under RDP, epsilon under GDP-CLT / PRV",
            "~10 s",
        ),
    ),
    (
        "li_glue_accounting",
        ReportSpec(
            _in("li_glue_accounting"),
            "Li et al. (GLUE)",
            "the GLUE table's epsilons (GDP-CLT / PRV) from each task's N, B, epochs",
            "~15 s",
        ),
    ),
    (
        "li_dialog_accounting",
        ReportSpec(
            _in("li_dialog_accounting"),
            "Li et al. (Persona-Chat)",
            "the Persona-Chat schedule (B, epochs) solved from the eps = 3 digits (GDP-CLT / PRV), the eps = 8 "
            "digits predicted from it",
            "~1 min",
        ),
    ),
    (
        "li_e2e",
        ReportSpec(
            _in("li_e2e"),
            "Li et al. (E2E table)",
            "BLEU / ROUGE-L of GPT-2 at eps = 3, 8, non-private: a small GPT-2 pretrained here vs the same from "
            "scratch",
            "~50 min (6 runs, LAUNCHER=joblib; + ~24 min once to pretrain)",
            experiment="li_e2e",
            runtime_paper="3 GPU runs of 4,108 steps",
        ),
    ),
    (
        "li_glue",
        ReportSpec(
            _in("li_glue"),
            "Li et al. (GLUE table, SST-2)",
            "the plain classifier against text infilling, and the head alone, at eps = 3, 8, non-private in the "
            "paper's privacy regime (B = 1000, 3 epochs; MiniLM-L6's top block on cached frozen layers on the CPU, "
            "RoBERTa-base full fine-tuning, LoRA and RGP on the paper profile)",
            "~105 min (18 runs, LAUNCHER=joblib JOBS=2, the 2 cores shared with the test suite for ~40 min; + ~3 min "
            "once to fit the MLM head)",
            experiment="li_glue",
            runtime_paper="13 GPU runs of 203 steps (RoBERTa-base, B = 1000)",
        ),
    ),
    (
        "li_glue_pilots",
        ReportSpec(
            _in("pilots"),
            "Li et al. (GLUE table, SST-2: the CPU profile's pilots)",
            "the learning rates the CPU li_glue uses, per row and column: every pilot run, trained and scored on the "
            "public tuning split li_glue removes from its private training set",
            "~2 h 10 min (26 runs, one at a time: 15 top-block runs of ~7 min, 11 head runs of ~1 min)",
            experiment="li_glue_pilots",
            runtime_paper="none: the paper profile uses the paper's learning rates",
            args=(
                "li_glue_pilots",
                "li_glue",
                "on 1,000 held-out sentences of the public tuning split (never dev, never a private sentence)",
            ),
        ),
    ),
    (
        "li_e2e_methods",
        ReportSpec(
            _in("li_e2e_methods"),
            "Li et al. (E2E table, methods)",
            "BLEU / ROUGE-L of GPT-2 by fine-tuning method (full, LoRA, prefix, RGP, top2, retrain) at eps = 3, 8, "
            "non-private",
            "~90 min (36 runs, LAUNCHER=joblib JOBS=2; estimated from 44 min for 18 runs of one seed, 2026-11-28; + "
            "~24 min once to pretrain, shared with li_e2e)",
            experiment="li_e2e_methods",
            runtime_paper="15 GPU runs of 4,108 steps (GPT-2 124M) and 3 from scratch",
        ),
    ),
    (
        "li_e2e_methods_pilots",
        ReportSpec(
            _in("pilots"),
            "Li et al. (E2E table, methods: the CPU profile's pilots)",
            "the learning rates the CPU li_e2e_methods uses, per method, private and non-private: every pilot run, "
            "trained on the E2E training pairs and scored by its loss on the dev split",
            "~115 min (36 runs, LAUNCHER=joblib JOBS=2, 2026-12-08, the 2 cores shared with tests and profiles for "
            "most of it; + ~24 min once to pretrain, shared with li_e2e)",
            experiment="li_e2e_methods_pilots",
            runtime_paper="none: the paper profile uses li_e2e's learning rate for every method",
            args=(
                "li_e2e_methods_pilots",
                "li_e2e_methods",
                "(token cross-entropy) on every reference of 50 E2E dev MRs (never test)",
            ),
        ),
    ),
    (
        "li_dialog",
        ReportSpec(
            _in("li_dialog"),
            "Li et al. (Persona-Chat table)",
            "F1 / perplexity of GPT-2 on dialog at eps = 3, 8, non-private (the Synthetic-Persona-Chat stand-in on "
            "the CPU)",
            "~24 min (12 runs, LAUNCHER=joblib JOBS=2; + ~24 min once to pretrain, shared with li_e2e)",
            experiment="li_dialog",
            runtime_paper="3 GPU runs of 2,567 steps (GPT-2 124M, Persona-Chat from task.data_dir)",
        ),
    ),
    (
        "li_hyperparams",
        ReportSpec(
            _in("li_hyperparams"),
            "Li et al. (batch size, learning rate)",
            "E2E BLEU at eps = 3 over a batch-size x learning-rate grid at fixed epochs (heatmap), sigma_eff = "
            "sigma N / B, the gradient-SNR against B",
            "~110 min (18 runs, LAUNCHER=joblib JOBS=2; + ~24 min once to pretrain, shared with li_e2e)",
            experiment="li_hyperparams",
            runtime_paper="12 GPU runs (GPT-2 124M, 10 epochs each)",
        ),
    ),
    (
        "li_ghost_clipping",
        ReportSpec(
            _in("li_ghost_clipping"),
            "Li et al. (ghost clipping figure)",
            "memory and throughput: non-private vs per-example hooks vs ghost vs bk (from make bench)",
            "~1 s (after make bench, ~40 min)",
        ),
    ),
    (
        "tang_budget",
        ReportSpec(
            _in("tang_budget"), "Tang & Lecuyer", "steps to epsilon=7, Phi = (sigma C / B)^2", "~20 s"
        ),
    ),
    (
        "tang_fig1_cifar10",
        ReportSpec(
            _in("tang_fig1"),
            "Tang & Lecuyer Fig. 1 (left)",
            "DP-SGD vs DP-Adam-Biased vs DP-AdamBC, CIFAR-10 CNN5",
            "~35 min (9 runs)",
            experiment="tang_fig1_cifar10",
            runtime_paper="9 GPU runs of 549 steps (175 s on one H100, the 9 at once; results/paper/)",
            args=("cifar10",),
        ),
    ),
    (
        "tang_fig1_snli",
        ReportSpec(
            _in("tang_fig1"),
            "Tang & Lecuyer Fig. 1 (right)",
            "DP-SGD vs DP-Adam-Biased vs DP-AdamBC, SNLI (MiniLM-L6 on CPU, BERT-base on GPU)",
            "~30 min (6 runs, LAUNCHER=joblib)",
            experiment="tang_fig1_snli",
            runtime_paper="9 GPU runs of 5,417 steps",
            args=("snli",),
        ),
    ),
    (
        "tang_table1",
        ReportSpec(
            _in("tang_table1"),
            "Tang & Lecuyer Table 1",
            "clean vs private second moments of DP-Adam on SNLI (diagnostics of the tang_fig1_snli runs)",
            "~30 min (the tang_fig1_snli runs; nothing more)",
            experiment="tang_fig1_snli",
            runtime_paper="the tang_fig1_snli GPU runs",
        ),
    ),
    (
        "tang_fig2",
        ReportSpec(
            _in("tang_fig2"),
            "Tang & Lecuyer Fig. 2",
            "histograms of clean vs private moments and updates (diagnostics of the tang_fig1_snli runs)",
            "~30 min (the tang_fig1_snli runs; nothing more)",
            experiment="tang_fig1_snli",
            runtime_paper="the tang_fig1_snli GPU runs",
        ),
    ),
    (
        "tang_fig3_snli",
        ReportSpec(
            _in("tang_fig3"),
            "Tang & Lecuyer Fig. 3 (SNLI)",
            "ablations: Phi' subtracted, gamma', gamma, beta",
            "~22 min (11 runs, LAUNCHER=joblib)",
            experiment="tang_fig3_snli",
            runtime_paper="11+ GPU runs of 5,417 steps",
            args=("snli",),
        ),
    ),
    (
        "tang_snli_pilots",
        ReportSpec(
            _in("pilots"),
            "Tang & Lecuyer Fig. 1 / Fig. 3, SNLI (the CPU profile's pilots)",
            "the learning rates the CPU tang_fig1_snli and tang_fig3_snli use: every pilot run, scored on SNLI test "
            "pairs outside the reported subset",
            "~20 min (12 runs, LAUNCHER=joblib)",
            experiment="tang_snli_pilots",
            runtime_paper="none: the paper profile uses the paper's tuned learning rates",
            args=(
                "tang_snli_pilots",
                ("tang_fig1_snli", "tang_fig3_snli"),
                "on 1,000 SNLI test pairs outside the 1,000 the tables report",
            ),
        ),
    ),
    (
        "chooi_dpadamw",
        ReportSpec(
            _in("chooi_dpadamw"),
            "Chooi et al. 2025 (DP-AdamW)",
            "DP-SGD vs DP-Adam vs DP-AdamBC vs DP-AdamW vs DP-AdamW-BC, CIFAR-10 CNN5, lr and lambda chosen on "
            "validation images",
            "~23 min (72 runs)",
            experiment="chooi_dpadamw",
            runtime_paper="324 GPU runs of 500 steps (36 grid points x eps = 1, 3, 7 x 3 seeds)",
        ),
    ),
    (
        "tang_fig3_cifar10",
        ReportSpec(
            _in("tang_fig3"),
            "Tang & Lecuyer Fig. 3 (CIFAR-10)",
            "ablations: Phi' subtracted, gamma', gamma, beta",
            "~60 min (15 runs)",
            experiment="tang_fig3_cifar10",
            runtime_paper="15 GPU runs of 549 steps",
            args=("cifar10",),
        ),
    ),
    (
        "ganesh_fig3",
        ReportSpec(
            _in("ganesh_fig3"),
            "Ganesh et al. Fig. 3",
            "private Adam variants x {DP-SGD at BandMF's RMSE, DP-BandMF, DP-SGD at BandMF's epsilon}, MLM on arXiv "
            "abstracts (pretrained MiniLM-L6 on CPU, TinyBERT on GPU)",
            "~60 min (40 runs, LAUNCHER=joblib; + a few minutes once to fit the MLM head)",
            experiment="ganesh_fig3",
            runtime_paper="thousands of GPU runs (tuning grid x 30 seeds)",
        ),
    ),
    (
        "ganesh_figs4_6",
        ReportSpec(
            _in("ganesh_figs4_6"),
            "Ganesh et al. Figs. 4-6",
            "negative v^ - Phi, ||g||/C, v against the bias (diagnostics of the ganesh_fig3 runs)",
            "the ganesh_fig3 runs; nothing more",
            experiment="ganesh_fig3",
            runtime_paper="the ganesh_fig3 runs",
        ),
    ),
    (
        "ganesh_fig3_pilots",
        ReportSpec(
            _in("pilots"),
            "Ganesh et al. Fig. 3 (the CPU profile's pilots)",
            "the starting learning rates of the CPU ganesh_fig3 (its non-private rows keep them; ganesh_fig3_tuning "
            "tunes the private rows): every pilot run, scored on the val split",
            "~10 min (11 runs, LAUNCHER=joblib)",
            experiment="ganesh_fig3_pilots",
            runtime_paper="none: the paper profile tunes every cell inside ganesh_fig3",
            args=(
                "ganesh_fig3_pilots",
                "ganesh_fig3",
                "on the val split (never the test split the table reports)",
            ),
        ),
    ),
    (
        "ganesh_fig3_tuning",
        ReportSpec(
            _in("pilots"),
            "Ganesh et al. Fig. 3 (the CPU profile's tuning)",
            "eta for every row, eps_s (IME / BC), DP-SGD's lr and momentum, eps_s1 and the clip (STP), per column, "
            "that the CPU ganesh_fig3 uses: every tuning run, scored on the val split",
            "~120 min (86 runs, LAUNCHER=joblib; ~230 core-minutes measured)",
            experiment="ganesh_fig3_tuning",
            runtime_paper="none: the paper profile tunes every cell inside ganesh_fig3",
            args=(
                "ganesh_fig3_tuning",
                ("ganesh_fig3", "ganesh_fig3_horizon"),
                "on the val split (never the test split the tables report)",
            ),
        ),
    ),
    (
        "ganesh_fig3_horizon",
        ReportSpec(
            _in("ganesh_horizon"),
            "Ganesh et al. Fig. 3 (horizon study)",
            "STP - post-processing, BandMF - DP-SGD and post-processing - DP-SGD with momentum against the number "
            "of steps (32, 64, 96 on CPU), the learning rate tuned at every horizon on val abstracts, scored again "
            "on held-out seeds at the longest, with standard errors and the diagnostics that explain them",
            "~310 min (110 runs, LAUNCHER=joblib; ~620 core-minutes measured)",
            experiment="ganesh_fig3_horizon",
            runtime_paper="GPU runs of ~500 and ~1,000 steps over the paper's grid x 5 seeds, after ganesh_fig3",
            also=("ganesh_fig3",),
            also_profiles=(
                "paper",
            ),  # its ~2,000-step runs are the longest horizon; the cpu profile runs all
        ),
    ),
    (
        "privacy_audit",
        ReportSpec(
            _in("privacy_audit"),
            "Steinke, Nasr & Jagielski 2023 (one-run auditing)",
            "audit epsilon, mu-GDP and f-DP lower bounds vs the claim, and the mechanism meter (sigma, sensitivity, q, "
            "noise correlation, joint noise, post-processing): every private variant x mechanism x sampler, each "
            "clipping engine, and controls with what caught each",
            "~7 min (175 one-run audits, each white-box one with its meter: 15 through a model task and the real "
            "clipping engines, 2 black-box CIFAR-10)",
        ),
    ),
    (
        "mf_amplified",
        ReportSpec(
            _in("mf_amplified"),
            "beyond the papers (amplified BandMF, Choquette-Choo et al. 2023)",
            "DP-SGD (Poisson) vs BandMF (cyclic / amplified cyclic Poisson) vs BLT at eps = 8 per DP-Adam "
            "variant, with each mechanism's noise RMSE",
            "~25 min (32 runs of 48 steps, 2 workers)",
            experiment="mf_amplified",
            runtime_paper="32 x tuning grid x 5 seeds GPU runs of 1,998 steps",
        ),
    ),
    (
        "lecture_mechanisms",
        ReportSpec(
            _in("lecture_mechanisms"),
            "Lecture notes on DP mechanisms",
            "classic vs analytic Gaussian, composition theorems",
            "~10 s",
        ),
    ),
)


for _name, _spec in _TABLES:
    REPORTS.register(_name, _spec)

# Groups accepted by ``make reproduce-table TABLE=...``; ``all`` in the order of REPORT.md.
GROUPS: dict[str, list[str]] = {
    "default": ["ganesh_fig2"],
    "privacy": [
        "ganesh_mechanisms",
        "li_e2e_accounting",
        "li_glue_accounting",
        "li_dialog_accounting",
        "tang_budget",
        "lecture_mechanisms",
    ],
    "all": [name for name, _ in _TABLES],
}


def spec(table_id: str) -> ReportSpec:
    """The spec of a table id (a ConfigError naming the valid ids when unknown)."""
    return REPORTS.get(table_id)


def resolve(table: str) -> list[str]:
    """Expand a table id or group name into table ids; unknown names fail with the valid choices."""
    if table in GROUPS:
        return GROUPS[table]
    if table in REPORTS:
        return [table]
    valid = [*REPORTS.names(), *sorted(GROUPS)]
    raise ValueError(f"unknown table {table!r}; valid tables and groups: {', '.join(valid)}")


def results_for(profile: str, base: Path | None = None) -> Path:
    """Where a profile's tables go: ``results/`` for cpu (the default, what CI regenerates), ``results/<profile>/``
    for another profile, so paper-scale tables never overwrite the CPU ones."""
    from dp_adam_bench.paths import results_dir

    base = base or results_dir()
    return base if profile == "cpu" else base / profile


def build(table_id: str, ctx: ReportContext | None = None) -> list[Path]:
    """Build one table. ``ctx.out`` is the results folder: a table of runs goes to its profile's folder in it
    (:func:`results_for`), an exact table to the folder itself."""
    ctx = ctx or ReportContext()
    table = spec(table_id)
    if table.experiment is not None:
        ctx = dataclasses.replace(ctx, out=results_for(ctx.profile, ctx.out))
    return table.function()(ctx, *table.args)
