"""The Fig. 2 benchmark (``bench_fig2.py``): its target, the whole 1-D logistic table end to end in 15 s."""

from __future__ import annotations

import pandas as pd

from .tables import verdict

FIG2_MAX_S = 15.0  # the target: the 1-D logistic Fig. 2 table end to end, seconds


def target_rows(fig2: pd.DataFrame | None) -> list[tuple[str, str, str, str]]:
    """(target, configuration, measured, verdict): one row per W&B mode measured."""
    name = f"1-D logistic Fig. 2 table end to end < {FIG2_MAX_S:g} s"
    if fig2 is None or fig2.empty:
        return [(name, "results_fig2.csv", "", "not measured yet")]
    return [
        (
            name,
            f"W&B {r.wandb_mode}, {int(r.runs)} runs",
            f"{r.total_s:.1f} s ({r.s_per_run:.2f} s a run)",
            verdict(r.total_s, FIG2_MAX_S, "s", strict=True),
        )
        for _, r in fig2.iterrows()
    ]
