"""Table ids -> report modules. Adding a table: one module in this package and one line here."""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ReportSpec:
    module: str
    paper: str
    shows: str
    runtime_cpu: str
    experiment: str | None = (
        None  # sweep preset to run before the report (None: the table is computed exactly)
    )
    runtime_paper: str = "same"


REPORTS: dict[str, ReportSpec] = {
    "ganesh_fig2": ReportSpec(
        "ganesh_fig2",
        "Ganesh et al. Fig. 2",
        "1-D logistic regression, private AdaGrad variants",
        "~2 min",
        experiment="ganesh_fig2",
    ),
    "ganesh_mechanisms": ReportSpec(
        "ganesh_mechanisms", "Ganesh et al. §5.2", "RMSE and epsilon of DP-SGD vs DP-BandMF", "~30 s"
    ),
    "ganesh_quadratic": ReportSpec(
        "ganesh_quadratic",
        "Ganesh et al. §4.1-4.3",
        "per-coordinate learning rates vs non-private 1/c on a 2-D quadratic",
        "~1 min",
        experiment="ganesh_quadratic",
    ),
    "li_e2e_accounting": ReportSpec(
        "li_e2e_accounting",
        "Li et al. (E2E)",
        "sigma calibrated under RDP, epsilon under GDP-CLT / PRV",
        "~10 s",
    ),
    "li_e2e": ReportSpec(
        "li_e2e",
        "Li et al. (E2E table)",
        "BLEU / ROUGE-L of GPT-2 at eps = 3, 8, non-private (a small GPT-2 from scratch on CPU)",
        "~35 min (3 runs)",
        experiment="li_e2e",
        runtime_paper="3 GPU runs of 4,108 steps",
    ),
    "li_ghost_clipping": ReportSpec(
        "li_ghost_clipping",
        "Li et al. (ghost clipping figure)",
        "memory and throughput: non-private vs per-example hooks vs ghost vs bk (from make bench)",
        "~1 s (after make bench, ~40 min)",
    ),
    "tang_budget": ReportSpec(
        "tang_budget", "Tang & Lecuyer", "steps to epsilon=7, Phi = (sigma C / B)^2", "~20 s"
    ),
    "tang_fig1_cifar10": ReportSpec(
        "tang_fig1_cifar10",
        "Tang & Lecuyer Fig. 1 (left)",
        "DP-SGD vs DP-Adam-Biased vs DP-AdamBC, CIFAR-10 CNN5",
        "~35 min (9 runs)",
        experiment="tang_fig1_cifar10",
        runtime_paper="9 GPU runs of 549 steps",
    ),
    "tang_fig1_snli": ReportSpec(
        "tang_fig1_snli",
        "Tang & Lecuyer Fig. 1 (right)",
        "DP-SGD vs DP-Adam-Biased vs DP-AdamBC, SNLI (MiniLM-L6 on CPU, BERT-base on GPU)",
        "~25 min (6 runs)",
        experiment="tang_fig1_snli",
        runtime_paper="9 GPU runs of 5,474 steps",
    ),
    "tang_table1": ReportSpec(
        "tang_table1",
        "Tang & Lecuyer Table 1",
        "clean vs private second moments of DP-Adam on SNLI (diagnostics of the tang_fig1_snli runs)",
        "~25 min (the tang_fig1_snli runs; nothing more)",
        experiment="tang_fig1_snli",
        runtime_paper="the tang_fig1_snli GPU runs",
    ),
    "tang_fig2": ReportSpec(
        "tang_fig2",
        "Tang & Lecuyer Fig. 2",
        "histograms of clean vs private moments and updates (diagnostics of the tang_fig1_snli runs)",
        "~25 min (the tang_fig1_snli runs; nothing more)",
        experiment="tang_fig1_snli",
        runtime_paper="the tang_fig1_snli GPU runs",
    ),
    "tang_fig3_snli": ReportSpec(
        "tang_fig3_snli",
        "Tang & Lecuyer Fig. 3 (SNLI)",
        "ablations: Phi' subtracted, gamma', gamma, beta",
        "~20 min (11 runs)",
        experiment="tang_fig3_snli",
        runtime_paper="11+ GPU runs of 5,474 steps",
    ),
    "tang_fig3_cifar10": ReportSpec(
        "tang_fig3_cifar10",
        "Tang & Lecuyer Fig. 3 (CIFAR-10)",
        "ablations: Phi' subtracted, gamma', gamma, beta",
        "~60 min (15 runs)",
        experiment="tang_fig3_cifar10",
        runtime_paper="15 GPU runs of 549 steps",
    ),
    "ganesh_fig3": ReportSpec(
        "ganesh_fig3",
        "Ganesh et al. Fig. 3",
        "private Adam variants x {DP-SGD, BandMF, DP-SGD} on BERT-tiny MLM (arXiv)",
        "~60 min (32 runs, untuned)",
        experiment="ganesh_fig3",
        runtime_paper="thousands of GPU runs (tuning grid x 30 seeds)",
    ),
    "ganesh_figs4_6": ReportSpec(
        "ganesh_figs4_6",
        "Ganesh et al. Figs. 4-6",
        "negative v^ - Phi, ||g||/C, v against the bias (diagnostics of the ganesh_fig3 runs)",
        "the ganesh_fig3 runs; nothing more",
        experiment="ganesh_fig3",
        runtime_paper="the ganesh_fig3 runs",
    ),
    "lecture_mechanisms": ReportSpec(
        "lecture_mechanisms",
        "Lecture notes (seed 001)",
        "classic vs analytic Gaussian, composition theorems",
        "~10 s",
    ),
}

# Groups accepted by ``make reproduce-table TABLE=...``.
GROUPS: dict[str, list[str]] = {
    "default": ["ganesh_fig2"],
    "privacy": ["ganesh_mechanisms", "li_e2e_accounting", "tang_budget", "lecture_mechanisms"],
}
GROUPS["all"] = list(REPORTS)


def resolve(table: str) -> list[str]:
    """Expand a table id or group name into table ids; unknown names fail with the valid choices."""
    if table in GROUPS:
        return GROUPS[table]
    if table in REPORTS:
        return [table]
    valid = sorted(REPORTS) + sorted(GROUPS)
    raise ValueError(f"unknown table {table!r}; valid tables and groups: {', '.join(valid)}")


def results_for(profile: str, base: Path | None = None) -> Path:
    """Where a profile's tables go: ``results/`` for cpu (the default, what CI regenerates), ``results/<profile>/``
    for another profile, so paper-scale tables never overwrite the CPU ones."""
    from dp_adam_bench.paths import results_dir

    base = base or results_dir()
    return base if profile == "cpu" else base / profile


@contextlib.contextmanager
def _results_in(folder: Path):
    old = os.environ.get("DP_ADAM_BENCH_RESULTS")
    os.environ["DP_ADAM_BENCH_RESULTS"] = str(folder)
    try:
        yield
    finally:
        if old is None:
            del os.environ["DP_ADAM_BENCH_RESULTS"]
        else:
            os.environ["DP_ADAM_BENCH_RESULTS"] = old


def build(table_id: str, profile: str = "cpu") -> list[Path]:
    spec = REPORTS[table_id]
    module = importlib.import_module(f"dp_adam_bench.report.{spec.module}")
    if spec.experiment is None:  # computed exactly: the same table at every profile
        return module.build(profile=profile)
    with _results_in(results_for(profile)):
        return module.build(profile=profile)
