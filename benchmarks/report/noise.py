"""The noise benchmark (``bench_noise.py``): its targets, the cost of correlated noise as a fraction of a DP step.

The fraction's denominator is the fastest flat-clipping DP step of the d = 4.4M model (BERT-tiny) in
``results_engines.csv``, so these targets read both CSVs.
"""

from __future__ import annotations

import pandas as pd

from .engines import best_flat
from .tables import fmt, quick_prefix, rows, verdict

BANDMF_FRACTION_MAX = 0.10  # the target: BandMF b = 128 noise per step / DP step at d = 4.4M
BLT_FRACTION_MAX = 0.02  # the target: BLT noise per step / DP step at d = 4.4M
D44_MODEL = "bert_tiny"  # the d = 4.4M model of results_engines.csv
D44_NOISE_MODEL = "tinybert_4.4M"  # the same d in results_noise.csv


def target_rows(noise: pd.DataFrame | None, eng: pd.DataFrame | None) -> list[tuple[str, str, str, str]]:
    """(target, configuration, measured, verdict): per mechanism, one row per batch size of the d = 4.4M model."""
    not_yet = "not measured yet"
    steps = []
    if eng is not None and not eng.empty:
        for b in sorted({int(b) for b in eng.loc[eng["model"] == D44_MODEL, "batch_size"]}):
            if (best := best_flat(eng, D44_MODEL, b)) is not None:
                steps.append((b, best))
    out = []
    for mech, limit, label in (
        ("bandmf_b128", BANDMF_FRACTION_MAX, "BandMF b=128"),
        ("blt_4", BLT_FRACTION_MAX, "BLT (4 buffers)"),
    ):
        name = f"{label} noise per step <= {100 * limit:.0f} % of the DP step at d = 4.4M"
        nrow = rows(noise, mechanism=mech, model=D44_NOISE_MODEL)
        nrow = nrow[nrow["ms_per_step_median"].notna()] if not nrow.empty else nrow
        if nrow.empty:
            out.append((name, "results_noise.csv", "", not_yet))
            continue
        ms = float(nrow.iloc[0].ms_per_step_median)
        n_thr = f", {fmt(nrow.iloc[0].threads)} thread(s)" if "threads" in nrow.columns else ""
        if not steps:
            out.append(
                (
                    name,
                    "results_noise.csv + results_engines.csv",
                    f"noise {ms:.1f} ms/step; no DP step of {D44_MODEL} (d = 4.4M) in results_engines.csv",
                    f"{not_yet} (run `python benchmarks/bench_engines.py --models {D44_MODEL} --merge`)",
                )
            )
            continue
        for b, best in steps:
            frac = ms / 1e3 / best.median_step_s
            out.append(
                (
                    name,
                    f"{D44_MODEL} ({int(best.params)} params), B={b}",
                    f"noise {ms:.1f} ms{n_thr} / DP step {best.median_step_s:.3f} s ({best['mode']}, "
                    f"{fmt(best.threads)} thread(s)) = {100 * frac:.1f} %",
                    quick_prefix(best) + verdict(frac, limit, "%"),
                )
            )
    return out
